// Package realloop runs the three sidecars (`csi-sidecars provisioner`, `attacher` and
// `resizer`, one process each, with upstream's default flags) under the real control loop:
// a real kube-controller-manager and kube-scheduler with fake nodes (internal/cluster), so
// that Pods with claims go through their whole life as in a cluster. The scheduler picks a
// node for each Pod, kube-controller-manager hands the claim to the provisioner, binds it,
// creates the VolumeAttachment for the attacher, hands growth to the resizer, and detaches
// and lets go of the claim and its volume after the Pod and the claim are deleted. The tests
// check the API objects and the test CSI driver's journal at each step. They skip when
// kube-controller-manager or kube-scheduler is not built (`make testenv`).
package realloop

import (
	"os"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/internal/cluster"
	"github.com/csi-sidecars/csi-sidecars/internal/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/e2e"
)

var (
	kube   controlplane.Shared
	binDir string
	// noLoop says why the real control loop cannot run: kube-apiserver and etcd are built
	// but kube-controller-manager or kube-scheduler is not. The tests then skip without a
	// control plane started or binaries built for them.
	noLoop error
)

func TestMain(m *testing.M) {
	// A missing kube-apiserver fails the package in e2e.Main, as everywhere else.
	if _, err := controlplane.Assets(); err == nil {
		if _, noLoop = cluster.Assets(); noLoop != nil {
			os.Exit(m.Run())
		}
	}
	os.Exit(e2e.Main(m, "../../..", &kube, &binDir))
}
