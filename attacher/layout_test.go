package attacher

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

// The attacher's parts sit below the Controller and beside each other: each imports, of
// this module, the core and the pure parts (finalizer, volume) at most, and the pure parts
// nothing but the core. The compiler refuses an import cycle, not an import across: a part
// that reached into another part would tie their state together again. What a part needs
// of another the Controller hands it as a value or a func.
func TestThePartsImportOnlyTheCoreAndThePureParts(t *testing.T) {
	const module = "github.com/csi-sidecars/csi-sidecars/"
	allowed := map[string][]string{
		// Pure: no API, no state.
		"finalizer": {"lifecycle"},
		"volume":    {},
		// Parts.
		"csicall":     {"lifecycle"},
		"nodeid":      {},
		"patch":       {"lifecycle", "attacher/finalizer"},
		"pvfinalizer": {"lifecycle", "attacher/finalizer", "attacher/volume"},
		"reconcile":   {"lifecycle", "attacher/volume"},
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
		t.Errorf("packages under attacher/: %v, want %v (a new part states what it may import here)", parts, want)
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
					t.Errorf("%s imports %s: a part of the attacher imports %v of this module only", path, own, allowed[part])
				}
			}
		}
	}
}
