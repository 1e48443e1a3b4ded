// Package migrate runs what `csi-sidecars migrate` wrote for a real driver's manifests:
// the csi-sidecars containers of csi-driver-host-path v1.18.0's plugin StatefulSet, as
// migrated in migrate/testdata/hostpath.out.yaml, each as a process with the container's
// own args and env. Only what must differ outside a cluster is substituted: the driver
// socket (the project's test CSI driver stands in for the hostpath driver), the kubeconfig
// and the Leases' namespace that a pod has in-cluster, the kubelet folders, the pod's node
// name and ports. They run against a real control plane with the real
// kube-controller-manager and kube-scheduler (internal/testkit/cluster), the real
// snapshot-controller and a real kubelet (internal/testkit/kubelet) for the registrar, and
// the test checks API objects and the driver's calls at each step of a volume's life.
package migrate

import (
	"os"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
)

var (
	kube   controlplane.Shared
	binDir string
)

func TestMain(m *testing.M) { os.Exit(e2e.Main(m, "../../..", &kube, &binDir)) }
