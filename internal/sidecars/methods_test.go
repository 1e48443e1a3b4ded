package sidecars

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// maxMethods is the most methods a type of the product may have. A type past it does
// several jobs whose state is tied together; its parts belong in types of their own, as the
// provisioner's record, deletion, capacity and sources are.
const maxMethods = 20

// notProduct are the trees of the module, from its root, that do not go into the binary:
// the test kit, the tests and the tools that build and report.
var notProduct = []string{"hack", "test", filepath.Join("internal", "testkit")}

// Every named type of the product has at most maxMethods methods, value and pointer
// receivers together. The packages are found by walking the module, so a sidecar added
// later is held to it without a change here.
func TestNoTypeHasMoreThanTwentyMethods(t *testing.T) {
	root := filepath.Join("..", "..")
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("module root: %v", err)
	}
	counts, err := methodCounts(root)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := counts["attacher.Sidecar"]; !ok {
		t.Fatalf("no methods of attacher.Sidecar found: the walk of %s missed the product", root)
	}
	for _, name := range slices.Sorted(maps.Keys(counts)) {
		if c := counts[name]; c.n > maxMethods {
			t.Errorf("%s has %d methods, more than %d (in %s): split it into parts",
				name, c.n, maxMethods, strings.Join(slices.Sorted(maps.Keys(c.files)), ", "))
		}
	}
}

// methodCount is how many methods a type has and the files that declare them.
type methodCount struct {
	n     int
	files map[string]bool
}

// methodCounts counts the methods declared on each named type of the product's packages
// under root, tests aside, keyed by the package's path from root and the type's name.
func methodCounts(root string) (map[string]*methodCount, error) {
	counts := map[string]*methodCount{}
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		if d.IsDir() {
			name := d.Name()
			if rel != "." && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" || slices.Contains(notProduct, rel)) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		pkg := filepath.ToSlash(filepath.Dir(rel))
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Recv == nil || len(fn.Recv.List) == 0 {
				continue
			}
			name, err := receiverType(fn.Recv.List[0].Type)
			if err != nil {
				return fmt.Errorf("%s: method %s: %w", path, fn.Name.Name, err)
			}
			key := pkg + "." + name
			c := counts[key]
			if c == nil {
				c = &methodCount{files: map[string]bool{}}
				counts[key] = c
			}
			c.n++
			c.files[filepath.ToSlash(rel)] = true
		}
		return nil
	})
	return counts, err
}

// receiverType is the name of the type of a method's receiver: T, *T, T[P] or *T[P].
func receiverType(expr ast.Expr) (string, error) {
	for {
		switch e := expr.(type) {
		case *ast.StarExpr:
			expr = e.X
		case *ast.ParenExpr:
			expr = e.X
		case *ast.IndexExpr:
			expr = e.X
		case *ast.IndexListExpr:
			expr = e.X
		case *ast.Ident:
			return e.Name, nil
		default:
			return "", fmt.Errorf("receiver of type %T", expr)
		}
	}
}
