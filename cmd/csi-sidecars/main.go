// Command csi-sidecars runs one Kubernetes CSI sidecar (attacher, resizer, provisioner, snapshotter,
// livenessprobe) on the shared lifecycle core: csi-sidecars <sidecar> [flags]; csi-sidecars migrate
// converts manifests that run upstream's images.
package main

import (
	"context"
	"os"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/internal/sidecars"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/migrate"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	code := lifecycle.Execute(context.Background(), newRoot(), os.Args[1:], os.Stderr)
	klog.FlushAndExit(klog.ExitFlushTimeout, code)
}

// newRoot is the command with every sidecar (internal/sidecars: adding one is one line
// there), and migrate, which converts upstream's manifests.
func newRoot() *cobra.Command {
	root := lifecycle.NewRootCommand("csi-sidecars", version, sidecars.All()...)
	root.AddCommand(migrate.NewCommand(version))
	return root
}
