package provisioner

import (
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The capacity owner walk follows controllers of any kind, as upstream's: the pod is
// controlled by a ReplicationController, which an operator's ConfigMap controls; with
// --capacity-ownerref-level=2 the CSIStorageCapacity objects are owned by the ConfigMap.
// RBAC is upstream's plus get on the one kind read on the way, which is the user's to
// grant; nothing is refused.
func TestCapacityOwnerOfAnyKind(t *testing.T) {
	s := newScenario(t, testdriver.Config{Topology: true})
	s.createNode("n1")
	s.createClass("late", func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	})
	ctx := s.ctx()
	cm, err := s.Client.CoreV1().ConfigMaps(s.Namespace).Create(ctx, &v1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "operator"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sel := map[string]string{"app": "csi-sidecars"}
	rc := &v1.ReplicationController{
		ObjectMeta: metav1.ObjectMeta{Name: "csi-controller", OwnerReferences: []metav1.OwnerReference{
			{APIVersion: "v1", Kind: "ConfigMap", Name: cm.Name, UID: cm.UID, Controller: ptr.To(true)}}},
		Spec: v1.ReplicationControllerSpec{Replicas: ptr.To[int32](0), Selector: sel, Template: &v1.PodTemplateSpec{
			ObjectMeta: metav1.ObjectMeta{Labels: sel}, Spec: v1.PodSpec{Containers: []v1.Container{{Name: "c", Image: "csi-sidecars"}}}}},
	}
	if rc, err = s.Client.CoreV1().ReplicationControllers(s.Namespace).Create(ctx, rc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Pods need the namespace's default ServiceAccount, which no controller makes here.
	if _, err := s.Client.CoreV1().ServiceAccounts(s.Namespace).Create(ctx, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "csi-controller-x", Labels: sel,
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "ReplicationController", Name: rc.Name, UID: rc.UID, Controller: ptr.To(true)}}},
		Spec: v1.PodSpec{Containers: []v1.Container{{Name: "c", Image: "csi-sidecars"}}, AutomountServiceAccountToken: ptr.To(false)}}
	if pod, err = s.Client.CoreV1().Pods(s.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Setenv("NAMESPACE", s.Namespace)
	t.Setenv("POD_NAME", pod.Name)
	rules := e2e.Rules{Cluster: upstreamClusterRules(snapshotVerbsV62), Namespace: append(slices.Clone(upstreamNamespaceRules),
		rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"replicationcontrollers"}, Verbs: []string{"get"}})}
	r := s.startReplica("replica-a", "--kubeconfig="+s.KubeconfigWithRules("csi-provisioner", rules),
		"--enable-capacity", "--capacity-poll-interval=1s", "--capacity-ownerref-level=2")
	r.WaitReady(t)
	s.WaitForHolder(s.leaseName, "replica-a")

	s.WaitUntil("a CSIStorageCapacity owned by the ConfigMap", func() bool {
		_, objs := s.capacities()
		return len(objs) == 1 && len(objs[0].OwnerReferences) == 1 && objs[0].OwnerReferences[0].UID == cm.UID
	})
	_, objs := s.capacities()
	if ref := objs[0].OwnerReferences[0]; ref.Kind != "ConfigMap" || ref.APIVersion != "v1" || ref.Name != cm.Name || ref.Controller == nil || !*ref.Controller {
		t.Errorf("owner %+v, want the ConfigMap as controller", ref)
	}
	e2e.NoForbidden(t, r) // the API server refused no request
}
