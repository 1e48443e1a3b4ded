package provisioner

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

// The provisioner's parts sit below the claim's way and beside each other: each imports,
// of this module, the core and the request's pure parts at most. The compiler refuses an
// import cycle, not an import across: a part that reached into another part would tie
// their state together again.
func TestThePartsImportOnlyTheCoreAndTheRequest(t *testing.T) {
	const module = "github.com/csi-sidecars/csi-sidecars/"
	allowed := map[string][]string{
		"request":  {"lifecycle"},
		"capacity": {"lifecycle", "provisioner/request"},
		"record":   {"lifecycle", "provisioner/request"},
		"sources":  {"lifecycle", "provisioner/request"},
		"deletion": {"lifecycle", "provisioner/request"},
		"refgrant": {},
	}
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	var parts []string
	for _, e := range entries {
		if e.IsDir() {
			parts = append(parts, e.Name())
		}
	}
	if want := slices.Sorted(maps.Keys(allowed)); !slices.Equal(parts, want) {
		t.Errorf("packages under provisioner/: %v, want %v (a new part states what it may import here)", parts, want)
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
			f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
			if err != nil {
				t.Fatal(err)
			}
			for _, imp := range f.Imports {
				p, _ := strconv.Unquote(imp.Path.Value)
				if own, ok := strings.CutPrefix(p, module); ok && !slices.Contains(allowed[part], own) {
					t.Errorf("%s imports %s: a part of the provisioner imports %v of this module only", path, own, allowed[part])
				}
			}
		}
	}
}
