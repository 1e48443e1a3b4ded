package resizer

import (
	"testing"

	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// upstreamRules are the rules of kubernetes-csi/external-resizer v2.3.0 (the same as v2.2.0)
// deploy/kubernetes/rbac.yaml: the ClusterRole external-resizer-runner and the Role
// external-resizer-cfg (the Leases). No Secrets (commented out upstream).
var upstreamRules = e2e.Rules{
	Cluster: []rbacv1.PolicyRule{
		e2e.Rule("", []string{"persistentvolumes"}, "get", "list", "watch", "patch"),
		e2e.Rule("", []string{"persistentvolumeclaims"}, "get", "list", "watch"),
		e2e.Rule("", []string{"pods"}, "get", "list", "watch"),
		e2e.Rule("", []string{"persistentvolumeclaims/status"}, "patch"),
		e2e.Rule("", []string{"events"}, "list", "watch", "create", "update", "patch"),
		e2e.Rule("storage.k8s.io", []string{"volumeattributesclasses"}, "get", "list", "watch"),
	},
	Namespace: []rbacv1.PolicyRule{
		e2e.Rule("coordination.k8s.io", []string{"leases"}, "get", "watch", "list", "delete", "update", "create"),
	},
}

// Upstream's own RBAC is enough: with a token of a ServiceAccount that holds exactly
// upstream's rules, the resizer expands and modifies volumes, and no request of it is
// refused.
func TestUpstreamRBACIsEnoughToExpandAndModify(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	silver := s.createClass("silver", map[string]string{"iops": "100"})
	gold := s.createClass("gold", map[string]string{"iops": "500"})
	expand := s.createPair("expand", "")
	modify := s.createPair("modify", silver)
	a := s.startReplica("replica-a", "--kubeconfig="+s.KubeconfigWithRules("csi-resizer", upstreamRules))
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	s.request(expand.name, "2Gi")
	s.setClass(modify.name, gold)
	s.WaitUntil("the PVC is expanded", func() bool { return capacityOf(s.pvc(expand.name)) == "2Gi" })
	s.WaitUntil("the PVC has class gold", func() bool {
		return ptr.Deref(s.pvc(modify.name).Status.CurrentVolumeAttributesClassName, "") == gold
	})
	e2e.NoForbidden(t, a)
}
