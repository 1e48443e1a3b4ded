package e2e

import (
	"fmt"

	"github.com/csi-sidecars/csi-sidecars/internal/sidecars"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// LeaseName is the Lease the sidecar of driver leads on, as the sidecar names it and the
// core sanitises it (upstream's names): the one place tests learn it.
func LeaseName(sidecar, driver string) string {
	s, ok := sidecars.Named(sidecar).(lifecycle.Sidecar)
	if !ok {
		panic(fmt.Sprintf("no sidecar %q that leads", sidecar))
	}
	return lifecycle.SanitizeName(s.LeaseName(driver))
}
