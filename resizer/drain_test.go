package resizer

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/draintest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// drainingClient stands for the core's connection to the driver while the replica drains:
// ControllerExpandVolume and ControllerModifyVolume get the core's refusal and never reach
// the driver. At the call it notes how many API actions the clientset had seen and takes
// the events recorded so far (those of the steps before the call), so that a test can
// tell what came after the call from what came before.
type drainingClient struct {
	csi.ControllerClient
	f   *fixture
	err error
	// actionsAtCall is the number of API actions before the refused call; -1 for none yet.
	actionsAtCall int
	// eventsBefore are the events recorded before the refused call.
	eventsBefore []string
}

func newDrainingClient(f *fixture, method string) *drainingClient {
	return &drainingClient{ControllerClient: f.controllerClient(), f: f, err: draintest.RefusedByDrain(f.t, method), actionsAtCall: -1}
}

func (d *drainingClient) refused() {
	d.actionsAtCall = len(d.f.kube.Actions())
	d.eventsBefore = d.f.events()
}

func (d *drainingClient) ControllerExpandVolume(context.Context, *csi.ControllerExpandVolumeRequest, ...grpc.CallOption) (*csi.ControllerExpandVolumeResponse, error) {
	d.refused()
	return nil, d.err
}

func (d *drainingClient) ControllerModifyVolume(context.Context, *csi.ControllerModifyVolumeRequest, ...grpc.CallOption) (*csi.ControllerModifyVolumeResponse, error) {
	d.refused()
	return nil, d.err
}

// checkNothingRecorded fails the test if no call was refused, or if anything was written
// or an event recorded after the refused call: a call the drain refused failed nothing,
// and the drain spends no write on it.
func (d *drainingClient) checkNothingRecorded() {
	t := d.f.t
	t.Helper()
	if d.actionsAtCall < 0 {
		t.Fatal("no CSI call was made, want one refused by the drain")
	}
	for _, a := range d.f.kube.Actions()[d.actionsAtCall:] {
		if v := a.GetVerb(); v != "get" && v != "list" && v != "watch" {
			t.Errorf("%s %s/%s after the refused call, want no write", v, a.GetResource().Resource, a.GetSubresource())
		}
	}
	if events := d.f.events(); len(events) != 0 {
		t.Errorf("events %q after the refused call, want none", events)
	}
}

// A ControllerExpandVolume the drain refused records nothing: no VolumeResizeFailed event,
// no failed status (no ControllerResizeError condition, not Infeasible), no write after
// it. What was written before the call (the resize in progress at the new size) stays,
// and the next sync expands.
func TestAnExpansionTheDrainRefusedRecordsNothing(t *testing.T) {
	f, c, _ := growingClaim(t, testdriver.Config{}, "2Gi")
	exp := c.expander.(*csiExpander)
	d := newDrainingClient(f, "ControllerExpandVolume")
	exp.client = d

	if err := c.sync("ns/claim"); !lifecycle.NotStarted(err) {
		t.Fatalf("sync: %v, want the refusal", err)
	}
	d.checkNothingRecorded()
	if !hasEvent(d.eventsBefore, "Normal Resizing") {
		t.Errorf("events before the call %q, want Resizing", d.eventsBefore)
	}
	got := f.pvc("claim")
	if s := got.Status.AllocatedResourceStatuses[v1.ResourceStorage]; s != v1.PersistentVolumeClaimControllerResizeInProgress {
		t.Errorf("resize status %q, want %q as written before the call", s, v1.PersistentVolumeClaimControllerResizeInProgress)
	}
	if cond := condition(got, v1.PersistentVolumeClaimControllerResizeError); cond != nil {
		t.Errorf("ControllerResizeError condition %+v, want none", cond)
	}
	if capacity := f.pv("pv-claim").Spec.Capacity[v1.ResourceStorage]; capacity.Cmp(resource.MustParse("1Gi")) != 0 {
		t.Errorf("PV capacity %s, want 1Gi", capacity.String())
	}
	if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 0 {
		t.Errorf("%d ControllerExpandVolume calls reached the driver, want none", n)
	}

	// The next sync (here, or the next leader's) expands.
	exp.client = d.ControllerClient
	f.settle()
	if err := c.sync("ns/claim"); err != nil {
		t.Fatal(err)
	}
	if capacity := f.pvc("claim").Status.Capacity[v1.ResourceStorage]; capacity.Cmp(resource.MustParse("2Gi")) != 0 {
		t.Errorf("PVC capacity %s after the next sync, want 2Gi", capacity.String())
	}
}

// A ControllerModifyVolume the drain refused records nothing: no VolumeModifyFailed event,
// no ModifyVolumeError condition, not Infeasible, no write after it. What was written
// before the call (the modification in progress) stays, and the next sync modifies.
func TestAModificationTheDrainRefusedRecordsNothing(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	pvc, pv, id := f.modifyPair("silver", "gold")
	c := newModifyFixtureWith(t, f, false, pvc, pv, class("silver", "100"), class("gold", "500"))
	d := newDrainingClient(f, "ControllerModifyVolume")
	c.modifier.client = d

	if err := c.sync("ns/claim"); !lifecycle.NotStarted(err) {
		t.Fatalf("sync: %v, want the refusal", err)
	}
	d.checkNothingRecorded()
	if !hasEvent(d.eventsBefore, "Normal "+reasonModify+" ") {
		t.Errorf("events before the call %q, want %s", d.eventsBefore, reasonModify)
	}
	got := f.pvc("claim")
	if st := got.Status.ModifyVolumeStatus; st == nil || st.Status != v1.PersistentVolumeClaimModifyVolumeInProgress || st.TargetVolumeAttributesClassName != "gold" {
		t.Errorf("modify status %+v, want InProgress to gold as written before the call", st)
	}
	if cond := condition(got, v1.PersistentVolumeClaimVolumeModifyVolumeError); cond != nil {
		t.Errorf("ModifyVolumeError condition %+v, want none", cond)
	}
	if n := len(f.calls(testdriver.MethodControllerModifyVolume)); n != 0 {
		t.Errorf("%d ControllerModifyVolume calls reached the driver, want none", n)
	}

	// The next sync (here, or the next leader's) modifies.
	c.modifier.client = d.ControllerClient
	f.settle()
	if err := c.sync("ns/claim"); err != nil {
		t.Fatal(err)
	}
	if v, _ := f.driver.Volume(id); v.MutableParameters["iops"] != "500" {
		t.Errorf("driver's volume parameters %v after the next sync, want iops 500", v.MutableParameters)
	}
	if got := f.pvc("claim").Status.CurrentVolumeAttributesClassName; got == nil || *got != "gold" {
		t.Errorf("current class %v after the next sync, want gold", got)
	}
}
