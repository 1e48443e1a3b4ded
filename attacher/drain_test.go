package attacher

import (
	"context"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/csi-sidecars/csi-sidecars/attacher/finalizer"
	"github.com/csi-sidecars/csi-sidecars/attacher/nodeid"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/draintest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// refuseCalls makes the driver's publish and unpublish calls of f refused by the drain,
// under the fixture's recordingClient (which still counts the calls tried).
func (f *fixture) refuseCalls(method string) *refused {
	r := &refused{ControllerClient: f.csi.ControllerClient, f: f, err: draintest.RefusedByDrain(f.t, method), actionsAtCall: -1}
	f.csi.ControllerClient = r
	return r
}

// refused is the CSI client under the fixture's recordingClient while the drain refuses
// calls: it answers ControllerPublishVolume and ControllerUnpublishVolume with the core's
// refusal, never reaching the driver (other calls go through), and remembers how many API actions the clientset had
// seen at the call, to tell the writes after it from those before.
type refused struct {
	csi.ControllerClient
	f             *fixture
	err           error
	actionsAtCall int
}

func (r *refused) ControllerPublishVolume(context.Context, *csi.ControllerPublishVolumeRequest, ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error) {
	r.actionsAtCall = len(r.f.kube.Actions())
	return nil, r.err
}

func (r *refused) ControllerUnpublishVolume(context.Context, *csi.ControllerUnpublishVolumeRequest, ...grpc.CallOption) (*csi.ControllerUnpublishVolumeResponse, error) {
	r.actionsAtCall = len(r.f.kube.Actions())
	return nil, r.err
}

// stop lets the driver's calls through again, as they are on the next leader.
func (r *refused) stop() { r.f.csi.ControllerClient = r.ControllerClient }

// checkNothingRecorded fails the test if the sync made no refused call, if the
// VolumeAttachment shows an attach or detach error, or if anything was written after the
// refused call, an event included (the attacher, as upstream, has no event recorder; an
// event written through the clientset would be an action after the call): a call the
// drain refused failed nothing, and the drain spends no write on it.
func (r *refused) checkNothingRecorded(name string) {
	t := r.f.t
	t.Helper()
	if r.actionsAtCall < 0 {
		t.Fatal("no CSI call was made, want one refused by the drain")
	}
	va := r.f.va(name)
	if va.Status.AttachError != nil || va.Status.DetachError != nil {
		t.Errorf("status attachError %+v, detachError %+v, want none", va.Status.AttachError, va.Status.DetachError)
	}
	for _, a := range r.f.kube.Actions()[r.actionsAtCall:] {
		if a.GetVerb() != "get" && a.GetVerb() != "list" && a.GetVerb() != "watch" {
			t.Errorf("%s %s/%s after the refused call, want no write", a.GetVerb(), a.GetResource().Resource, a.GetSubresource())
		}
	}
}

// A ControllerPublishVolume the drain refused records nothing: no attachError, no event,
// no write after the call. The finalizers on the VolumeAttachment and the PV, written
// before the call, stay: the next leader publishes and marks the attachment attached.
func TestAPublishTheDrainRefusedRecordsNothing(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	f := newFixture(t, defaultConfig(), backend, standard()(volID)...)
	r := f.refuseCalls("ControllerPublishVolume")

	if err := f.sync("va"); !lifecycle.NotStarted(err) {
		t.Fatalf("sync: %v, want the refusal", err)
	}
	r.checkNothingRecorded("va")
	if got, want := f.writes(), []string{"patch persistentvolumes", "patch volumeattachments"}; !slices.Equal(got, want) {
		t.Errorf("API writes %q, want only the finalizers before the call, %q", got, want)
	}
	va := f.va("va")
	if va.Status.Attached || !finalizer.Has(va.Finalizers, ourFinalizer) || va.Annotations[nodeid.Annotation] != testNodeID {
		t.Errorf("VolumeAttachment finalizers %v, annotations %v, attached %v: want the finalizer and node ID written before the call, not attached",
			va.Finalizers, va.Annotations, va.Status.Attached)
	}
	if !finalizer.Has(f.pv("pv").Finalizers, ourFinalizer) {
		t.Errorf("PV finalizers %v, want %s kept", f.pv("pv").Finalizers, ourFinalizer)
	}
	if n := countCalls(backend.Journal(), testdriver.MethodControllerPublishVolume); n != 0 {
		t.Errorf("%d ControllerPublishVolume calls reached the driver, want none", n)
	}

	// The next leader publishes.
	r.stop()
	f.waitForCache("va", func(va *storagev1.VolumeAttachment) bool { return finalizer.Has(va.Finalizers, ourFinalizer) })
	if err := f.sync("va"); err != nil {
		t.Fatal(err)
	}
	if va := f.va("va"); !va.Status.Attached || va.Status.AttachError != nil {
		t.Errorf("status after the next leader's publish %+v, want attached without an error", va.Status)
	}
}

// A ControllerUnpublishVolume the drain refused records nothing: no detachError, no event,
// no write at all. The finalizer stays and the attachment stays attached: the volume is
// still published in the driver, and the next leader unpublishes it.
func TestAnUnpublishTheDrainRefusedRecordsNothing(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	f := newFixture(t, defaultConfig(), backend,
		newPV("pv", volID, withFinalizer),
		newVA("va", "pv", attachedWith(ourFinalizer), deleting),
		newCSINode(testNode, testNodeID))
	publishDirectly(t, f, volID, testNodeID)
	r := f.refuseCalls("ControllerUnpublishVolume")

	if err := f.sync("va"); !lifecycle.NotStarted(err) {
		t.Fatalf("sync: %v, want the refusal", err)
	}
	r.checkNothingRecorded("va")
	if got := f.writes(); len(got) != 0 {
		t.Errorf("API writes %q, want none", got)
	}
	va := f.va("va")
	if !finalizer.Has(va.Finalizers, ourFinalizer) || !va.Status.Attached {
		t.Errorf("finalizers %v, attached %v: want the finalizer kept and still attached", va.Finalizers, va.Status.Attached)
	}
	if !finalizer.Has(f.pv("pv").Finalizers, ourFinalizer) {
		t.Errorf("PV finalizers %v, want %s kept", f.pv("pv").Finalizers, ourFinalizer)
	}
	if v, _ := backend.Volume(volID); len(v.Published) != 1 {
		t.Errorf("driver: published to %v, want still to %s", v.Published, testNodeID)
	}

	// The next leader unpublishes.
	r.stop()
	if err := f.sync("va"); err != nil {
		t.Fatal(err)
	}
	if v, _ := backend.Volume(volID); len(v.Published) != 0 {
		t.Errorf("driver: still published to %v after the next leader's unpublish", v.Published)
	}
}
