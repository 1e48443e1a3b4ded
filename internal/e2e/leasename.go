package e2e

import (
	"fmt"

	"github.com/csi-sidecars/csi-sidecars/attacher"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner"
	"github.com/csi-sidecars/csi-sidecars/resizer"
)

// LeaseName is the Lease the sidecar of driver leads on, as the sidecar names it and the
// core sanitises it (upstream's names): the one place tests learn it.
func LeaseName(sidecar, driver string) string {
	var s lifecycle.Sidecar
	switch sidecar {
	case "attacher":
		s = attacher.New()
	case "provisioner":
		s = provisioner.New()
	case "resizer":
		s = resizer.New()
	default:
		panic(fmt.Sprintf("no sidecar %q", sidecar))
	}
	return lifecycle.SanitizeName(s.LeaseName(driver))
}
