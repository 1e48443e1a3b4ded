package lifecycle

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"go/types"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/layout"
)

const module = layout.Module

// allowed states the core's parts and what each imports of this module. The parts sit
// below package lifecycle and beside each other; none imports lifecycle (the compiler
// would refuse the cycle), and each imports another part only where it says so here.
var allowed = map[string][]string{
	"budget": {},                   // the API budget, its clients' transport and the events' sink
	"cached": {},                   // what the informer caches keep of an object
	"lease":  {"lifecycle/cached"}, // the Lease: watch, acquire, the term's lock and timing
	"outage": {},                   // lists and watches through API server outages
}

// leadingOnly are the parts that only leading sidecars need: a Server has no Lease, no
// API server and no informer cache.
var leadingOnly = []string{"budget", "cached", "lease", "outage"}

// serverPath are the files of package lifecycle that run a Server (and, for http.go, every
// sidecar): nothing in them, nor in what they call of the package, may use a leading-only
// part.
var serverPath = []string{"server.go", "serve.go", "http.go"}

func TestThePartsImportOnlyWhatTheyMay(t *testing.T) {
	layout.CheckParts(t, "lifecycle", allowed)
	for _, part := range leadingOnly {
		if _, ok := allowed[part]; !ok {
			t.Errorf("leading-only part %s is not a part", part)
		}
	}
}

// The Server path uses nothing of the Lease, the budget or the caches: its files import no
// leading-only part, and neither they nor any function or method of package lifecycle
// they reach (calls, followed through the package) names a leading-only part or a field of
// one's type. A Server then runs with none of them, whatever else package lifecycle hosts.
func TestTheServerPathUsesNoLeadingOnlyPart(t *testing.T) {
	for _, path := range serverPath {
		for _, own := range layout.OwnImports(t, path) {
			if part, ok := strings.CutPrefix(own, "lifecycle/"); ok && slices.Contains(leadingOnly, part) {
				t.Errorf("%s imports %s, which only leading sidecars need", path, own)
			}
		}
	}
	uses, reached := leadingUses(t, ".", serverPath)
	for _, u := range uses {
		t.Error(u)
	}
	t.Logf("from %v: %v", serverPath, reached)
	// The walk follows the package's own calls: a Server that ends stops the process.
	if !slices.Contains(reached, "process.stop") {
		t.Errorf("the walk from %v reached %v, not process.stop: it follows no call", serverPath, reached)
	}
}

// leadingUses type-checks the package in dir and returns where the declarations of the
// roots files, and every function, method or package-level variable of the package that
// they reach, use a leading-only part: its package, or a struct field whose type names it;
// and the names of what they reach.
//
// The package is checked on its own, every import an empty package: what the check needs
// is which of the package's own declarations an identifier denotes and which import a
// qualified name comes from, and both resolve without the imports' contents.
func leadingUses(t *testing.T, dir string, roots []string) (uses, reached []string) {
	t.Helper()
	fset := token.NewFileSet()
	paths, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	byName := map[string]*ast.File{}
	for _, path := range paths {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
		byName[filepath.Base(path)] = f
	}
	info := &types.Info{Defs: map[*ast.Ident]types.Object{}, Uses: map[*ast.Ident]types.Object{}}
	conf := types.Config{Importer: emptyImporter{}, Error: func(error) {}}
	pkg, _ := conf.Check(module+"lifecycle", fset, files, info)
	if pkg == nil {
		t.Fatal("type-checking package lifecycle failed")
	}

	// leadingPart is the leading-only part an identifier names as a package, or "".
	leadingPart := func(id *ast.Ident) string {
		if pn, ok := info.Uses[id].(*types.PkgName); ok {
			if part, ok := strings.CutPrefix(pn.Imported().Path(), module+"lifecycle/"); ok && slices.Contains(leadingOnly, part) {
				return part
			}
		}
		return ""
	}
	// The package's own declarations with a body to follow, and the fields whose type names
	// a leading-only part.
	decls := map[types.Object]ast.Node{}
	fields := map[types.Object]string{}
	for _, f := range files {
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				decls[info.Defs[d.Name]] = d
			case *ast.GenDecl:
				for _, s := range d.Specs {
					if vs, ok := s.(*ast.ValueSpec); ok {
						for _, n := range vs.Names {
							decls[info.Defs[n]] = vs
						}
					}
				}
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			st, ok := n.(*ast.StructType)
			if !ok {
				return true
			}
			for _, field := range st.Fields.List {
				part := ""
				ast.Inspect(field.Type, func(n ast.Node) bool {
					if id, ok := n.(*ast.Ident); ok && part == "" {
						part = leadingPart(id)
					}
					return true
				})
				for _, name := range field.Names {
					if part != "" {
						fields[info.Defs[name]] = part
					}
				}
			}
			return true
		})
	}

	type visit struct {
		node ast.Node
		via  string
	}
	var queue []visit
	seen := map[ast.Node]bool{}
	for _, name := range roots {
		f := byName[name]
		if f == nil {
			t.Fatalf("no file %s in package lifecycle", name)
		}
		for _, d := range f.Decls {
			queue = append(queue, visit{d, name})
			seen[d] = true
			if gd, ok := d.(*ast.GenDecl); ok {
				for _, s := range gd.Specs {
					seen[s] = true
				}
			}
		}
	}
	for len(queue) > 0 {
		v := queue[0]
		queue = queue[1:]
		ast.Inspect(v.node, func(n ast.Node) bool {
			id, ok := n.(*ast.Ident)
			if !ok {
				return true
			}
			pos := fset.Position(id.Pos())
			where := fmt.Sprintf("%s:%d", filepath.Base(pos.Filename), pos.Line)
			if part := leadingPart(id); part != "" {
				uses = append(uses, fmt.Sprintf("%s (%s) uses lifecycle/%s, which only leading sidecars need", where, v.via, part))
				return true
			}
			obj := info.Uses[id]
			if obj == nil || obj.Pkg() != pkg {
				return true
			}
			if fn, ok := obj.(*types.Func); ok {
				obj = fn.Origin()
			}
			if part, ok := fields[obj]; ok {
				uses = append(uses, fmt.Sprintf("%s (%s) uses field %s of a lifecycle/%s type, which only leading sidecars need", where, v.via, id.Name, part))
			}
			if d, ok := decls[obj]; ok && !seen[d] {
				seen[d] = true
				reached = append(reached, declName(obj))
				queue = append(queue, visit{d, v.via + " → " + declName(obj)})
			}
			return true
		})
	}
	return uses, reached
}

// declName is a function's name, with its receiver's type for a method.
func declName(obj types.Object) string {
	fn, ok := obj.(*types.Func)
	if !ok {
		return obj.Name()
	}
	recv := fn.Signature().Recv()
	if recv == nil {
		return fn.Name()
	}
	typ := recv.Type()
	if p, ok := typ.(*types.Pointer); ok {
		typ = p.Elem()
	}
	if named, ok := typ.(*types.Named); ok {
		return named.Obj().Name() + "." + fn.Name()
	}
	return fn.Name()
}

// emptyImporter imports every package as an empty one, named after its path's last
// element (before a major version suffix).
type emptyImporter struct{}

func (emptyImporter) Import(path string) (*types.Package, error) {
	elems := strings.Split(path, "/")
	name := elems[len(elems)-1]
	if len(elems) > 1 && len(name) > 1 && name[0] == 'v' && strings.Trim(name[1:], "0123456789") == "" {
		name = elems[len(elems)-2]
	}
	pkg := types.NewPackage(path, name)
	pkg.MarkComplete()
	return pkg, nil
}
