package attacher

import (
	"testing"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/layout"
)

// The attacher's parts sit below the Controller and beside each other: each imports, of
// this module, the core and the pure parts (finalizer, volume) at most, and the pure parts
// nothing but the core. The compiler refuses an import cycle, not an import across: a part
// that reached into another part would tie their state together again. What a part needs
// of another the Controller hands it as a value or a func.
func TestThePartsImportOnlyTheCoreAndThePureParts(t *testing.T) {
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
	layout.CheckParts(t, "attacher", allowed)
}
