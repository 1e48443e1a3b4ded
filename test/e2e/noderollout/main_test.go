// Package noderollout measures what a node DaemonSet's rollout of node-driver-registrar
// does to the node's registration of its CSI driver, on a real kubelet
// (internal/testkit/kubelet), with csi-sidecars' registrar (`csi-sidecars
// node-driver-registrar`) and with a model of upstream's v2.17.0
// (internal/testkit/upstreamregistrar), each pod's registrar a process of its own. The test
// CSI driver serves in the test process at <PluginsDir>/<driver>/csi.sock; a watch on the
// node's CSINode records every interval during which the driver was missing from it.
//
// The scenarios (scenarios in rollout_test.go): a rollout with maxUnavailable, one with
// maxSurge, two pods on one node of which the older is deleted (aws-ebs-csi-driver #2812),
// and the registration socket removed by another process. The tests assert what is a
// property of csi-sidecars' registrar (and, for the two pods, the reported bug as a property
// of the model); BenchmarkRegistrationThroughRollouts (make bench) runs every scenario with
// both and prints how long the driver was missing, whether it came back, and whether a
// registrar was left serving a socket file that was gone. Figures are printed, never
// asserted.
package noderollout

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstreamregistrar"
)

const root = "../../.."

var (
	kube   controlplane.Shared
	binDir string
	// modelBin is the model of upstream's registrar, built with the binaries.
	modelBin string
)

func TestMain(m *testing.M) { os.Exit(run(m)) }

func run(m *testing.M) int {
	flag.Parse()
	if !testing.Short() && os.Getenv(controlplane.SkipEnv) != "1" {
		dir, err := os.MkdirTemp("", "noderollout-model-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		if modelBin, err = upstreamregistrar.Build(ctx, root, dir); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	return e2e.Main(m, root, &kube, &binDir)
}
