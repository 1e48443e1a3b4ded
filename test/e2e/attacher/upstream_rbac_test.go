package attacher

import (
	"context"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// upstreamRules are the rules of kubernetes-csi/external-attacher v4.13.0
// deploy/kubernetes/rbac.yaml: the ClusterRole external-attacher-runner and the Role
// external-attacher-cfg (the Leases). No events, no Secrets (commented out upstream).
var upstreamRules = e2e.Rules{
	Cluster: []rbacv1.PolicyRule{
		e2e.Rule("", []string{"persistentvolumes"}, "get", "list", "watch", "patch"),
		e2e.Rule("storage.k8s.io", []string{"csinodes"}, "get", "list", "watch"),
		e2e.Rule("storage.k8s.io", []string{"volumeattachments"}, "get", "list", "watch", "patch"),
		e2e.Rule("storage.k8s.io", []string{"volumeattachments/status"}, "patch"),
	},
	Namespace: []rbacv1.PolicyRule{
		e2e.Rule("coordination.k8s.io", []string{"leases"}, "get", "watch", "list", "delete", "update", "create"),
	},
}

// Upstream's own RBAC is enough: with a token of a ServiceAccount that holds exactly
// upstream's rules, the attacher attaches and detaches, takes and releases its Lease, and
// no request of it is refused.
func TestUpstreamRBACIsEnoughToAttachAndDetach(t *testing.T) {
	const n = 5
	s := newScenario(t, testdriver.Config{Latency: 20 * time.Millisecond})
	ids := s.volumes(n)
	a := s.start("replica-a", "--kubeconfig="+s.KubeconfigWithRules("csi-attacher", upstreamRules))
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	s.attach(n)
	s.waitAllAttached(n)
	for i := range n {
		if err := s.Client.StorageV1().VolumeAttachments().Delete(context.Background(), s.vaName(i), metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	s.WaitUntil("every VolumeAttachment detached and gone", func() bool { return len(s.attachments()) == 0 })
	for _, id := range ids {
		if v, _ := s.Driver.Volume(id); len(v.Published) != 0 {
			t.Errorf("volume %s still published to %v", id, v.Published)
		}
	}
	e2e.NoForbidden(t, a)
}
