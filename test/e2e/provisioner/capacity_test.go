package provisioner

import (
	"fmt"
	"maps"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// capacities returns the driver's CSIStorageCapacity objects of the namespace by
// "class@segment", with their capacity in bytes (-1 for none).
func (s *scenario) capacities() (map[string]int64, []storagev1.CSIStorageCapacity) {
	s.T.Helper()
	list, err := s.Client.StorageV1().CSIStorageCapacities(s.Namespace).List(s.ctx(), metav1.ListOptions{
		LabelSelector: labels.Set{"csi.storage.k8s.io/drivername": s.driver}.String()})
	if err != nil {
		s.T.Fatal(err)
	}
	out := map[string]int64{}
	for _, o := range list.Items {
		k := o.StorageClassName + "@" + labels.Set(o.NodeTopology.MatchLabels).String()
		if _, dup := out[k]; dup {
			k += "#" + o.Name
		}
		out[k] = -1
		if o.Capacity != nil {
			out[k] = o.Capacity.Value()
		}
	}
	return out, list.Items
}

// createOwnerPod creates a ReplicaSet and a pod it controls, as a Deployment of the
// sidecar would have them (no controller runs: nothing else happens to them).
func (s *scenario) createOwnerPod() (*appsv1.ReplicaSet, *v1.Pod) {
	s.T.Helper()
	sel := map[string]string{"app": "csi-sidecars"}
	rs := &appsv1.ReplicaSet{ObjectMeta: metav1.ObjectMeta{Name: "csi-controller"}, Spec: appsv1.ReplicaSetSpec{
		Replicas: ptr.To[int32](0),
		Selector: &metav1.LabelSelector{MatchLabels: sel},
		Template: v1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: sel}, Spec: v1.PodSpec{Containers: []v1.Container{{Name: "c", Image: "csi-sidecars"}}}},
	}}
	rs, err := s.Client.AppsV1().ReplicaSets(s.Namespace).Create(s.ctx(), rs, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	// Pods need the namespace's default ServiceAccount, which no controller makes here.
	if _, err := s.Client.CoreV1().ServiceAccounts(s.Namespace).Create(s.ctx(), &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "csi-controller-x", Labels: sel,
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: rs.Name, UID: rs.UID, Controller: ptr.To(true)}}},
		Spec: v1.PodSpec{Containers: []v1.Container{{Name: "c", Image: "csi-sidecars"}}, AutomountServiceAccountToken: ptr.To(false)}}
	if pod, err = s.Client.CoreV1().Pods(s.Namespace).Create(s.ctx(), pod, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	return rs, pod
}

func TestCapacityObjectsAppearPerSegmentAndClassFollowTheDriverAndObsoleteOnesGo(t *testing.T) {
	seg := func(node string) map[string]string { return map[string]string{testdriver.TopologyKey: node} }
	s := newScenario(t, testdriver.Config{Topology: true})
	n1, n2 := s.createNode("n1"), s.createNode("n2")
	late := func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	}
	fast, slow := s.createClass("fast", late), s.createClass("slow", late)
	s.createClass("now", func(sc *storagev1.StorageClass) { sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingImmediate) })
	rules := []testdriver.CapacityRule{
		{Segment: seg(n1), Parameters: map[string]string{"type": "fast"}, AvailableCapacity: 100 << 20, MaximumVolumeSize: 60 << 20},
		{Segment: seg(n1), AvailableCapacity: 1 << 30},
		{Segment: seg(n2), AvailableCapacity: 2 << 30},
	}
	s.Driver.SetCapacityRules(rules)
	rs, pod := s.createOwnerPod()
	// The process inherits the test's environment: the pod it runs in, as the downward
	// API would say.
	t.Setenv("NAMESPACE", s.Namespace)
	t.Setenv("POD_NAME", pod.Name)

	start := time.Now()
	r := s.startReplica("replica-a", "--enable-capacity", "--capacity-poll-interval=1s", "--capacity-ownerref-level=1")
	r.WaitReady(t)
	s.WaitForHolder(s.leaseName, "replica-a")

	key := func(class *storagev1.StorageClass, node string) string {
		return class.Name + "@" + labels.Set(seg(node)).String()
	}
	want := map[string]int64{key(fast, n1): 100 << 20, key(fast, n2): 2 << 30, key(slow, n1): 1 << 30, key(slow, n2): 2 << 30}
	s.WaitUntil("one CSIStorageCapacity per segment and late-binding class", func() bool {
		got, _ := s.capacities()
		return maps.Equal(got, want)
	})
	t.Logf("FIGURE capacity objects published %v after start", time.Since(start).Round(time.Millisecond))
	_, objs := s.capacities()
	for _, o := range objs {
		if o.Labels["csi.storage.k8s.io/managed-by"] != "external-provisioner" || !strings.HasPrefix(o.Name, "csisc-") ||
			len(o.OwnerReferences) != 1 || o.OwnerReferences[0].UID != rs.UID || o.OwnerReferences[0].Kind != "ReplicaSet" {
			t.Errorf("object %s: labels %v, owners %+v; want upstream's labels and the ReplicaSet as owner", o.Name, o.Labels, o.OwnerReferences)
		}
		if o.StorageClassName == fast.Name && o.NodeTopology.MatchLabels[testdriver.TopologyKey] == n1 &&
			(o.MaximumVolumeSize == nil || o.MaximumVolumeSize.Value() != 60<<20) {
			t.Errorf("object %s: maximumVolumeSize %v, want the driver's 60Mi", o.Name, o.MaximumVolumeSize)
		}
	}

	// The storage fills up: the objects follow at the next poll.
	rules[0].AvailableCapacity, rules[2].AvailableCapacity = 10<<20, 0
	s.Driver.SetCapacityRules(rules)
	changed := time.Now()
	want[key(fast, n1)], want[key(fast, n2)], want[key(slow, n2)] = 10<<20, 0, 0
	s.WaitUntil("the objects following the driver", func() bool {
		got, _ := s.capacities()
		return maps.Equal(got, want)
	})
	t.Logf("FIGURE capacity change published %v after the driver's answer changed (poll 1s)", time.Since(changed).Round(time.Millisecond))

	// A class goes: its objects go.
	if err := s.Client.StorageV1().StorageClasses().Delete(s.ctx(), slow.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	delete(want, key(slow, n1))
	delete(want, key(slow, n2))
	s.WaitUntil("the deleted class's objects gone", func() bool {
		got, _ := s.capacities()
		return maps.Equal(got, want)
	})

	r.Signal(t, syscall.SIGTERM)
	if code := r.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("exit code %d after SIGTERM, want 0", code)
	}
	if got, _ := s.capacities(); !maps.Equal(got, want) {
		t.Errorf("objects after shutdown %v, want them kept for the next leader: %v", got, fmt.Sprint(want))
	}
}
