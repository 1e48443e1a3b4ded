// Command csi-test-sidecar runs the test sidecar on the lifecycle core, for the core's
// end-to-end tests: csi-test-sidecar test [shared flags].
package main

import (
	"context"
	"os"

	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testsidecar"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

func main() {
	root := lifecycle.NewRootCommand("csi-test-sidecar", "test", testsidecar.New())
	klog.FlushAndExit(klog.ExitFlushTimeout, lifecycle.Execute(context.Background(), root, os.Args[1:], os.Stderr))
}
