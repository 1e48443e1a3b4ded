// Package layout checks that a package tree reads in parts: the sub-packages of a folder
// are the parts a test names, and each part imports, of this module, only what the test
// allows it. The compiler refuses an import cycle, not an import across: a part that
// reached into another would tie their state together again.
package layout

import (
	"go/parser"
	"go/token"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// Module is this module's import path, with a trailing slash.
const Module = "github.com/csi-sidecars/csi-sidecars/"

// CheckParts fails t unless the folders of the current directory (testdata aside) are
// exactly the keys of allowed, and each one's non-test Go files import of this module only
// the packages allowed lists for it (paths without Module). tree names the tree in the
// messages ("attacher").
func CheckParts(t *testing.T, tree string, allowed map[string][]string) {
	t.Helper()
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	var parts []string
	for _, e := range entries {
		if e.IsDir() && e.Name() != "testdata" {
			parts = append(parts, e.Name())
		}
	}
	if want := slices.Sorted(maps.Keys(allowed)); !slices.Equal(parts, want) {
		t.Errorf("packages under %s/: %v, want %v (a new part states what it may import here)", tree, parts, want)
	}
	for _, part := range parts {
		files, err := filepath.Glob(filepath.Join(part, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		for _, path := range files {
			if strings.HasSuffix(path, "_test.go") {
				continue
			}
			for _, own := range OwnImports(t, path) {
				if !slices.Contains(allowed[part], own) {
					t.Errorf("%s imports %s: a part of %s imports %v of this module only", path, own, tree, allowed[part])
				}
			}
		}
	}
}

// OwnImports are the imports of this module of the Go file at path, without Module.
func OwnImports(t *testing.T, path string) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	var own []string
	for _, imp := range f.Imports {
		p, _ := strconv.Unquote(imp.Path.Value)
		if o, ok := strings.CutPrefix(p, Module); ok {
			own = append(own, o)
		}
	}
	return own
}
