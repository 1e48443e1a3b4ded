package provisioner

import (
	"slices"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// As upstream v6.4: a released volume still attached to a node is not deleted until it is
// detached, and the wait is a Normal VolumeDelete event on the PersistentVolume, not a
// Warning VolumeFailedDelete, nor a failed deletion in the metrics. Once the attachment is
// gone the volume is deleted.
func TestReleasedVolumeStillAttachedWaitsWithANormalEvent(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	class := s.createClass("fast", nil)
	a := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)
	claim := s.createClaim("data", class.Name, "")
	s.WaitUntil("the claim's PersistentVolume", func() bool { return len(s.pvsByClaim()[claim.UID]) == 1 })
	pv := s.pvsByClaim()[claim.UID][0]
	// The attachment exists before the replica that deletes starts, so its caches hold it
	// before it takes any work: no window in which a deletion could miss it.
	a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Fatalf("replica-a exited %d after SIGTERM, want 0", code)
	}
	va := &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: s.name("va")}, Spec: storagev1.VolumeAttachmentSpec{
		Attacher: s.driver, NodeName: "node-1", Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(pv.Name)}}}
	if _, err := s.Client.StorageV1().VolumeAttachments().Create(s.ctx(), va, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Client.StorageV1().VolumeAttachments().Delete(s.ctx(), va.Name, metav1.DeleteOptions{}) })
	b := s.startReplica("replica-b")
	s.WaitForHolder(s.leaseName, "replica-b")
	b.WaitReady(t)
	s.markReleased(pv)
	want := "persistentvolume " + pv.Name + " is still attached to node node-1, waiting for detach"
	s.WaitUntil("a VolumeDelete event on "+pv.Name, func() bool {
		return slices.ContainsFunc(s.pvEvents(pv.Name), func(e v1.Event) bool {
			return e.Type == v1.EventTypeNormal && e.Reason == "VolumeDelete" && e.Message == want
		})
	})
	for _, e := range s.pvEvents(pv.Name) {
		if e.Type == v1.EventTypeWarning {
			t.Errorf("Warning event %s on %s: %s", e.Reason, pv.Name, e.Message)
		}
	}
	if calls := s.Driver.Calls(testdriver.MethodDeleteVolume); len(calls) != 0 {
		t.Fatalf("DeleteVolume called while attached: %+v", calls)
	}
	_, metrics := b.Get("/metrics")
	if n, _, err := e2e.MetricTotal(metrics, "controller_persistentvolume_delete_failed_total", nil); err != nil || n != 0 {
		t.Errorf("controller_persistentvolume_delete_failed_total %v (%v), want 0: a postponed deletion is no failure", n, err)
	}

	if err := s.Client.StorageV1().VolumeAttachments().Delete(s.ctx(), va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// Deleted and let go: the API server's own pv-protection finalizer may keep it
	// Terminating, as no kube-controller-manager runs here.
	s.WaitUntil("the volume deleted and its PersistentVolume deleted", func() bool {
		got, err := s.Client.CoreV1().PersistentVolumes().Get(s.ctx(), pv.Name, metav1.GetOptions{})
		_, inDriver := s.Driver.Volume(pv.Spec.CSI.VolumeHandle)
		return !inDriver && (apierrors.IsNotFound(err) || err == nil && got.DeletionTimestamp != nil)
	})
}

// pvEvents are the events about the PersistentVolume name, of any namespace (those of a
// cluster-scoped object go to "default").
func (s *scenario) pvEvents(name string) []v1.Event {
	s.T.Helper()
	list, err := s.Client.CoreV1().Events("").List(s.ctx(), metav1.ListOptions{FieldSelector: "involvedObject.kind=PersistentVolume,involvedObject.name=" + name})
	if err != nil {
		s.T.Fatal(err)
	}
	return list.Items
}
