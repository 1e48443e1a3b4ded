package cluster

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	apiwait "k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
)

func TestAssetsNamesTheMissingBinaryAndHowToBuildIt(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(controlplane.AssetsEnv, dir)
	for _, bin := range []string{"etcd", "kube-apiserver", SchedulerBinary} {
		if err := os.WriteFile(filepath.Join(dir, bin), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_, err := Assets()
	if err == nil {
		t.Fatal("Assets() succeeded without kube-controller-manager")
	}
	for _, want := range []string{"make testenv", filepath.Join(dir, ControllerManagerBinary) + " is missing"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Assets() error %q does not mention %q", err, want)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, ControllerManagerBinary), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got, err := Assets(); err != nil || got != dir {
		t.Errorf("Assets() = %q, %v; want %q", got, err, dir)
	}
}

func TestPercentileIsNearestRank(t *testing.T) {
	var ds []time.Duration
	for i := 1; i <= 100; i++ {
		ds = append(ds, time.Duration(101-i)*time.Millisecond)
	}
	for p, want := range map[float64]time.Duration{50: 50 * time.Millisecond, 99: 99 * time.Millisecond, 100: 100 * time.Millisecond, 1: time.Millisecond} {
		if got := Percentile(ds, p); got != want {
			t.Errorf("Percentile(1..100ms, %v) = %v, want %v", p, got, want)
		}
	}
	if got := Percentile([]time.Duration{7}, 99); got != 7 {
		t.Errorf("Percentile of one value = %v", got)
	}
	if got := Percentile(nil, 50); got != 0 {
		t.Errorf("Percentile of none = %v", got)
	}
}

// The workload tracks each stage from the objects the control loop and the sidecars write;
// here the test writes them, on a fake clientset.
func TestWorkloadRecordsEachStageFromTheObjects(t *testing.T) {
	const ns, driver, node = "ns", "d.csi.test", "n1"
	ctx, kube, w := newTestWorkload(t, ns, driver)
	if _, err := kube.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{}); err != nil {
		t.Errorf("default ServiceAccount: %v", err)
	}
	if sc, err := kube.StorageV1().StorageClasses().Get(ctx, w.Class(), metav1.GetOptions{}); err != nil ||
		*sc.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer || !*sc.AllowVolumeExpansion || sc.Provisioner != driver {
		t.Fatalf("StorageClass: %+v, %v", sc, err)
	}
	if vac, err := kube.StorageV1().VolumeAttributesClasses().Get(ctx, w.AttributesClass(), metav1.GetOptions{}); err != nil ||
		vac.DriverName != driver || vac.Parameters["iops"] != "5000" {
		t.Fatalf("VolumeAttributesClass: %+v, %v", vac, err)
	}
	if err := w.CreatePod(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	wait := func(stage Stage) {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := w.Wait(wctx, stage); err != nil {
			t.Fatal(err)
		}
	}
	claims, pods := kube.CoreV1().PersistentVolumeClaims(ns), kube.CoreV1().Pods(ns)
	claim, err := claims.Get(ctx, "app", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The PersistentVolume is seen before the claim's annotation: node-selected is implied.
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-1"},
		Spec: corev1.PersistentVolumeSpec{
			ClaimRef:               &corev1.ObjectReference{Namespace: ns, Name: "app", UID: claim.UID},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: "vol-1"}},
		},
	}
	if _, err := kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	wait(Provisioned)
	claim.Annotations = map[string]string{"volume.kubernetes.io/selected-node": node}
	claim.Spec.VolumeName = "pvc-1"
	claim.Status = corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound, Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}
	if claim, err = claims.Update(ctx, claim, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	wait(Bound)
	pod, err := pods.Get(ctx, "app", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod.Spec.NodeName = node
	if _, err := pods.Update(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	wait(Scheduled)
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: "csi-1"},
		Spec:       storagev1.VolumeAttachmentSpec{Attacher: driver, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To("pvc-1")}},
	}
	if va, err = kube.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	va.Status.Attached = true
	if _, err := kube.StorageV1().VolumeAttachments().Update(ctx, va, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	wait(Attached)

	if err := w.Grow(ctx, "app", "2Gi"); err != nil {
		t.Fatal(err)
	}
	if claim, err = claims.Get(ctx, "app", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	claim.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("2Gi")}
	if _, err := claims.Update(ctx, claim, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	wait(Grown)

	if err := w.Modify(ctx, "app", w.AttributesClass()); err != nil {
		t.Fatal(err)
	}
	if claim, err = claims.Get(ctx, "app", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	if c := claim.Spec.VolumeAttributesClassName; c == nil || *c != w.AttributesClass() {
		t.Fatalf("claim's attributes class %v, want %s", c, w.AttributesClass())
	}
	// Another class is not the one asked for.
	claim.Status.CurrentVolumeAttributesClassName = ptr.To("other")
	if claim, err = claims.Update(ctx, claim, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	if err := w.Wait(short, Modified); err == nil {
		t.Error("modified with another class current")
	}
	cancel()
	claim.Status.CurrentVolumeAttributesClassName = ptr.To(w.AttributesClass())
	if _, err := claims.Update(ctx, claim, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	wait(Modified)

	if err := w.DeletePod(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if err := kube.StorageV1().VolumeAttachments().Delete(ctx, "csi-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	wait(Detached)
	if err := w.DeleteClaim(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	wait(ClaimGone)
	if err := kube.CoreV1().PersistentVolumes().Delete(ctx, "pvc-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	wait(VolumeDeleted)

	it, _ := w.Item("app")
	if it.PersistentVolume != "pvc-1" || it.VolumeHandle != "vol-1" || it.Node != node || it.VolumeAttachment != "csi-1" {
		t.Errorf("item: %+v", it)
	}
	for _, s := range Stages() {
		if it.Times[s].IsZero() {
			t.Errorf("stage %s not recorded", s)
		}
	}
	if !it.Times[NodeSelected].Equal(it.Times[Provisioned]) {
		t.Errorf("node-selected at %v, provisioned at %v: the implied stage should be recorded with the one that implies it",
			it.Times[NodeSelected], it.Times[Provisioned])
	}
	rows := w.Summary()
	if len(rows) != len(DefaultSpans()) {
		t.Errorf("summary has %d spans, want %d:\n%s", len(rows), len(DefaultSpans()), FormatSummary(rows))
	}
	for _, r := range rows {
		if r.N != 1 || r.P50 < 0 || r.P99 != r.P50 {
			t.Errorf("span %s: %+v", r.Span.Name, r)
		}
	}
}

func TestWaitSaysWhereThePodsStand(t *testing.T) {
	ctx := context.Background()
	kube := fake.NewClientset()
	w, err := NewWorkload(ctx, kube, WorkloadOptions{Namespace: "ns", Driver: "d"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.CreatePod(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	err = w.Wait(short, Attached)
	if err == nil || !strings.Contains(err.Error(), "1 of 1 Pods did not reach attached") || !strings.Contains(err.Error(), "app: reached [pod-created]") {
		t.Errorf("Wait error = %v", err)
	}
	if err := w.Wait(ctx, Attached, "other"); err == nil {
		t.Error("Wait for an unknown Pod succeeded")
	}
}

// Throughput is how many Pods went through a span over the time from the first one's start
// of it to the last one's end, whatever the overlap.
func TestSummaryThroughputIsPodsOverTheSpansWholeTime(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	w := &Workload{items: map[string]*item{}}
	for i, name := range []string{"a", "b", "c", "d"} {
		start := t0.Add(time.Duration(i) * time.Second)
		w.items[name] = &item{name: name, times: map[Stage]time.Time{PodCreated: start, NodeSelected: start.Add(2 * time.Second)}}
		w.order = append(w.order, name)
	}
	rows := w.Summary(Span{"select node", []Stage{PodCreated}, NodeSelected})
	if len(rows) != 1 {
		t.Fatalf("rows: %+v", rows)
	}
	// Four Pods from t0 (a's creation) to t0+5s (d's node selected).
	if r := rows[0]; r.N != 4 || r.PerSecond != 0.8 || r.P50 != 2*time.Second {
		t.Errorf("summary %+v, want 4 Pods at 0.8 per second, p50 2s", r)
	}
}

// A Pod deleted and created again for its bound claim goes through its own stages anew:
// scheduled and attached on the new Pod's objects, not the old one's.
func TestRecreatedPodIsTrackedAnew(t *testing.T) {
	const ns, driver, node = "ns", "d.csi.test", "n1"
	ctx, kube, w := newTestWorkload(t, ns, driver)
	wait := func(stage Stage) {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := w.Wait(wctx, stage); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.CreatePod(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if err := w.RecreatePod(ctx, "app"); err == nil {
		t.Error("RecreatePod of a Pod that was not deleted succeeded")
	}
	pods, vas := kube.CoreV1().Pods(ns), kube.StorageV1().VolumeAttachments()
	claim, err := kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "app", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-1"},
		Spec: corev1.PersistentVolumeSpec{
			ClaimRef:               &corev1.ObjectReference{Namespace: ns, Name: "app", UID: claim.UID},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: "vol-1"}},
		},
	}
	if _, err := kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	schedule := func() {
		t.Helper()
		pod, err := pods.Get(ctx, "app", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		pod.Spec.NodeName = node
		if _, err := pods.Update(ctx, pod, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	attach := func() {
		t.Helper()
		va := &storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: "csi-1"},
			Spec:       storagev1.VolumeAttachmentSpec{Attacher: driver, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To("pvc-1")}},
			Status:     storagev1.VolumeAttachmentStatus{Attached: true},
		}
		if _, err := vas.Create(ctx, va, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	schedule()
	attach()
	wait(Attached)
	first, _ := w.Item("app")
	if err := w.DeletePod(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if err := vas.Delete(ctx, "csi-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	wait(Detached)
	// The fake API server gives no UIDs: the old Pod and its successor differ only in
	// being there. Wait until the Pod cache no longer shows the old one, as a real
	// cluster's different UIDs would tell them apart.
	if err := apiwait.PollUntilContextTimeout(ctx, 5*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		_, err := w.pods.Pods(ns).Get("app")
		return err != nil, nil
	}); err != nil {
		t.Fatalf("the Pod cache still shows the deleted Pod: %v", err)
	}

	if err := w.RecreatePod(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	pod, err := pods.Get(ctx, "app", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(pod.Spec.Volumes) != 1 || pod.Spec.Volumes[0].PersistentVolumeClaim == nil || pod.Spec.Volumes[0].PersistentVolumeClaim.ClaimName != "app" {
		t.Errorf("recreated Pod's volumes: %+v; want the claim app", pod.Spec.Volumes)
	}
	it, _ := w.Item("app")
	for _, s := range []Stage{Scheduled, Attached, PodDeleted, Detached} {
		if !it.Times[s].IsZero() {
			t.Errorf("stage %s of the old Pod kept after RecreatePod", s)
		}
	}
	if it.Node != "" || it.VolumeAttachment != "" || !it.Times[Provisioned].Equal(first.Times[Provisioned]) {
		t.Errorf("after RecreatePod: %+v; want no node, no VolumeAttachment, the claim's stages kept", it)
	}
	schedule()
	wait(Scheduled)
	attach()
	wait(Attached)
	again, _ := w.Item("app")
	if !again.Times[Attached].After(first.Times[Attached]) || again.Node != node || again.VolumeAttachment != "csi-1" {
		t.Errorf("recreated Pod: %+v; want attached anew on %s", again, node)
	}
	// The new Pod is the one DeletePod deletes.
	if err := w.DeletePod(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if _, err := pods.Get(ctx, "app", metav1.GetOptions{}); err == nil {
		t.Error("the recreated Pod is still there after DeletePod")
	}
}

// Every driver of MoreDrivers is installed on each node as Driver is: a CSIDriver, an entry
// in the CSINode and in the node ID annotation; unregister deletes their CSIDrivers.
func TestMoreDriversAreInstalledOnEveryNode(t *testing.T) {
	ctx := context.Background()
	kube := fake.NewClientset()
	c := &Cluster{kube: kube, opts: Options{Driver: "a.csi.test", MoreDrivers: []string{"b.csi.test"}, TopologyKey: "topo"},
		nodes: []string{"n0"}, nodeID: map[string]string{"n0": "id0"}}
	if err := c.register(ctx); err != nil {
		t.Fatal(err)
	}
	csiNode, err := kube.StorageV1().CSINodes().Get(ctx, "n0", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node, err := kube.CoreV1().Nodes().Get(ctx, "n0", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"a.csi.test", "b.csi.test"} {
		if _, err := kube.StorageV1().CSIDrivers().Get(ctx, d, metav1.GetOptions{}); err != nil {
			t.Errorf("CSIDriver %s: %v", d, err)
		}
		found := false
		for _, e := range csiNode.Spec.Drivers {
			if e.Name == d && e.NodeID == "id0" && len(e.TopologyKeys) == 1 && e.TopologyKeys[0] == "topo" {
				found = true
			}
		}
		if !found {
			t.Errorf("CSINode n0 lacks %s with node ID id0 and key topo: %+v", d, csiNode.Spec.Drivers)
		}
		if want := `"` + d + `":"id0"`; !strings.Contains(node.Annotations[annCSINodeID], want) {
			t.Errorf("node ID annotation %q lacks %s", node.Annotations[annCSINodeID], want)
		}
	}
	if node.Labels["topo"] != "id0" {
		t.Errorf("node labels %v; want topo=id0", node.Labels)
	}
	if err := c.unregister(ctx); err != nil {
		t.Fatal(err)
	}
	if list, err := kube.StorageV1().CSIDrivers().List(ctx, metav1.ListOptions{}); err != nil || len(list.Items) != 0 {
		t.Errorf("CSIDrivers after unregister: %+v, %v", list, err)
	}
}

// newTestWorkload is a Workload of driver in namespace ns on a fake clientset, closed with
// the test; ctx bounds the test.
func newTestWorkload(t *testing.T, ns, driver string) (context.Context, *fake.Clientset, *Workload) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	kube := fake.NewClientset()
	w, err := NewWorkload(ctx, kube, WorkloadOptions{Namespace: ns, Driver: driver,
		AttributesClass: ns + "-fast", AttributesParameters: map[string]string{"iops": "5000"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Close)
	return ctx, kube, w
}
