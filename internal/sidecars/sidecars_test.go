package sidecars

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// P8, P15: every sidecar gets the core's shutdown and safety promises by registering with
// it, and handles no signal, Lease or exit of its own. A sidecar package (its tree, tests
// aside) that imports signal handling or leader election, or exits the process, would
// keep a promise only by its own code, or break it.
func TestNoSidecarHandlesSignalsLeasesOrExit(t *testing.T) {
	forbiddenImports := []string{"os/signal", "k8s.io/client-go/tools/leaderelection", "k8s.io/client-go/tools/leaderelection/resourcelock"}
	forbiddenCalls := map[string][]string{"os": {"Exit"}, "klog": {"Fatal", "Fatalf", "Fatalln", "Exit", "Exitf", "FlushAndExit"}}
	for _, s := range All() {
		dir := filepath.Join("..", "..", Dir(s.Name()))
		files := 0
		err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			files++
			f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
			if err != nil {
				return err
			}
			for _, imp := range f.Imports {
				if p, _ := strconv.Unquote(imp.Path.Value); slices.Contains(forbiddenImports, p) {
					t.Errorf("%s imports %s: the core handles signals and Leases", path, p)
				}
			}
			ast.Inspect(f, func(n ast.Node) bool {
				sel, ok := n.(*ast.SelectorExpr)
				if !ok {
					return true
				}
				if pkg, ok := sel.X.(*ast.Ident); ok && slices.Contains(forbiddenCalls[pkg.Name], sel.Sel.Name) {
					t.Errorf("%s uses %s.%s: only the core ends the process", path, pkg.Name, sel.Sel.Name)
				}
				return true
			})
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if files == 0 {
			t.Errorf("no Go files in %s, the package of sidecar %s", dir, s.Name())
		}
	}
}
