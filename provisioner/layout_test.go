package provisioner

import (
	"testing"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/layout"
)

// The provisioner's parts sit below the claim's way and beside each other: each imports,
// of this module, the core and the request's pure parts at most. The compiler refuses an
// import cycle, not an import across: a part that reached into another part would tie
// their state together again.
func TestThePartsImportOnlyTheCoreAndTheRequest(t *testing.T) {
	allowed := map[string][]string{
		"request":  {"lifecycle"},
		"capacity": {"lifecycle", "provisioner/request"},
		"record":   {"lifecycle", "provisioner/request"},
		"sources":  {"lifecycle", "provisioner/request"},
		"deletion": {"lifecycle", "provisioner/request"},
		"refgrant": {},
	}
	layout.CheckParts(t, "provisioner", allowed)
}
