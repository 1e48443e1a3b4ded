package attacher

import (
	"context"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// 50 VolumeAttachments attach (finalizers, node ID annotation, metadata, PV finalizers,
// published in the driver) and detach (unpublished, VolumeAttachments gone, PV finalizers
// released when the PVs are deleted), with no overlapping operations.
func TestFiftyVolumeAttachmentsAttachAndDetach(t *testing.T) {
	const n = 50
	s := newScenario(t, testdriver.Config{Latency: 20 * time.Millisecond})
	ids := s.volumes(n)
	a := s.start("replica-a", fastAPI...)
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	before := s.apiWrites()
	began := time.Now()
	s.attach(n)
	s.waitAllAttached(n)
	attachTime := time.Since(began)
	attachWrites := s.apiWrites() - before

	vas := s.attachments()
	for i, id := range ids {
		va := vas[s.vaName(i)]
		if !hasString(va.Finalizers, s.finalizer()) || va.Annotations["csi.alpha.kubernetes.io/node-id"] != s.nodeID {
			t.Errorf("%s: finalizers %v, annotations %v", va.Name, va.Finalizers, va.Annotations)
		}
		if va.Status.AttachmentMetadata[testdriver.PublishContextDevicePath] != "/dev/testdriver/"+id || va.Status.AttachError != nil {
			t.Errorf("%s: status %+v", va.Name, va.Status)
		}
		pv, err := s.Client.CoreV1().PersistentVolumes().Get(context.Background(), s.pvName(i), metav1.GetOptions{})
		if err != nil || !hasString(pv.Finalizers, s.finalizer()) {
			t.Errorf("PV %s: finalizers %v (%v)", s.pvName(i), pv.Finalizers, err)
		}
		if v, _ := s.Driver.Volume(id); len(v.Published) != 1 {
			t.Errorf("volume %s published to %v, want %s", id, v.Published, s.nodeID)
		} else if _, ok := v.Published[s.nodeID]; !ok {
			t.Errorf("volume %s published to %v, want %s", id, v.Published, s.nodeID)
		}
	}

	before = s.apiWrites()
	began = time.Now()
	for i := range n {
		if err := s.Client.StorageV1().VolumeAttachments().Delete(context.Background(), s.vaName(i), metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	s.WaitUntil("every VolumeAttachment deleted", func() bool { return len(s.attachments()) == 0 })
	detachTime := time.Since(began)
	detachWrites := s.apiWrites() - before
	for _, id := range ids {
		if v, _ := s.Driver.Volume(id); len(v.Published) != 0 {
			t.Errorf("volume %s still published to %v", id, v.Published)
		}
	}

	// PVs keep the finalizer until they are deleted and no VolumeAttachment uses them.
	// (Without kube-controller-manager, pv-protection keeps the deleted PVs around.)
	for i := range n {
		if err := s.Client.CoreV1().PersistentVolumes().Delete(context.Background(), s.pvName(i), metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	s.WaitUntil("every PV released by the attacher", func() bool {
		for i := range n {
			pv, err := s.Client.CoreV1().PersistentVolumes().Get(context.Background(), s.pvName(i), metav1.GetOptions{})
			if err == nil && hasString(pv.Finalizers, s.finalizer()) {
				return false
			}
			if err != nil && !apierrors.IsNotFound(err) {
				return false
			}
		}
		return true
	})
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", len(o), o)
	}
	if !a.Running() {
		t.Errorf("replica exited with %d", a.ExitCode)
	}
	t.Logf("FIGURE attach: %d VolumeAttachments attached in %v, %.2f API writes per attach", n, attachTime.Round(time.Millisecond), attachWrites/n)
	t.Logf("FIGURE detach: %d VolumeAttachments detached and gone in %v, %.2f API writes per detach", n, detachTime.Round(time.Millisecond), detachWrites/n)
	if attachWrites/n > 3 || detachWrites/n > 1 {
		t.Errorf("%.2f writes per attach, %.2f per detach; want at most 3 and 1", attachWrites/n, detachWrites/n)
	}
}

// The reconciler repairs a VolumeAttachment whose volume the driver no longer has
// published: it publishes it again, and the VolumeAttachment stays attached.
func TestReconcilerRepublishesWhatTheDriverLost(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	ids := s.volumes(2)
	a := s.start("replica-a", "--reconcile-sync=1s")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)
	s.attach(2)
	s.waitAllAttached(2)

	lost := time.Now()
	if _, err := s.setup.ControllerUnpublishVolume(context.Background(), &csi.ControllerUnpublishVolumeRequest{VolumeId: ids[0], NodeId: s.nodeID}); err != nil {
		t.Fatal(err)
	}
	s.WaitForCalls("a publish of the lost volume after it was lost", func(calls []testdriver.Call) bool {
		for _, c := range e2e.CallsOn(calls, a, testdriver.MethodControllerPublishVolume) {
			if c.VolumeID == ids[0] && c.Start.After(lost) && c.Code == "OK" {
				return true
			}
		}
		return false
	})
	repaired := time.Since(lost)
	if v, _ := s.Driver.Volume(ids[0]); !hasKey(v.Published, s.nodeID) {
		t.Errorf("volume %s published to %v after the repair", ids[0], v.Published)
	}
	if va := s.attachments()[s.vaName(0)]; !va.Status.Attached {
		t.Errorf("VolumeAttachment status %+v", va.Status)
	}
	for _, c := range e2e.CallsOn(s.Driver.Journal(), a, testdriver.MethodControllerPublishVolume) {
		if c.VolumeID == ids[1] && c.Start.After(lost) {
			t.Errorf("the volume the driver agreed on was published again at %v", c.Start)
		}
	}
	t.Logf("FIGURE reconcile: lost publication repaired after %v (--reconcile-sync=1s)", repaired.Round(time.Millisecond))
}

// A driver without PUBLISH_UNPUBLISH_VOLUME gets the trivial handler: every
// VolumeAttachment is marked attached with no CSI call and no finalizer, so deleting it
// needs nothing from the attacher.
func TestDriverWithoutPublishGetsTrivialHandler(t *testing.T) {
	const n = 5
	s := newScenario(t, testdriver.Config{ControllerCapabilities: []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
	}})
	s.volumes(n)
	a := s.start("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)
	s.attach(n)
	s.waitAllAttached(n)

	for name, va := range s.attachments() {
		if len(va.Finalizers) != 0 || len(va.Annotations) != 0 {
			t.Errorf("%s: finalizers %v, annotations %v; want none", name, va.Finalizers, va.Annotations)
		}
	}
	for i := range n {
		pv, err := s.Client.CoreV1().PersistentVolumes().Get(context.Background(), s.pvName(i), metav1.GetOptions{})
		if err != nil || hasString(pv.Finalizers, s.finalizer()) {
			t.Errorf("PV %s: finalizers %v (%v)", s.pvName(i), pv.Finalizers, err)
		}
	}
	if calls := e2e.CallsOn(s.Driver.Journal(), a, testdriver.MethodControllerPublishVolume); len(calls) != 0 {
		t.Errorf("%d publish calls, want none", len(calls))
	}
	for i := range n {
		if err := s.Client.StorageV1().VolumeAttachments().Delete(context.Background(), s.vaName(i), metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if left := len(s.attachments()); left != 0 {
		t.Errorf("%d VolumeAttachments left after deletion, want none (no finalizer)", left)
	}
}

func hasString(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func hasKey(m map[string]bool, k string) bool { _, ok := m[k]; return ok }
