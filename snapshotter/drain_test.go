package snapshotter

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"google.golang.org/grpc"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/draintest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// checkNothingRecorded fails t if the content has an error on its status, if anything was
// written after the driver's call (the last entry of the log, call), or if an event was
// recorded: a call the drain refused failed nothing, and the drain spends no write on it.
func (w *world) checkNothingRecorded(name, call string) {
	w.t.Helper()
	c := w.content(name)
	if c.Status != nil && c.Status.Error != nil {
		w.t.Errorf("content %s has error %q on its status, want none", name, *c.Status.Error.Message)
	}
	if i := slices.Index(w.log, call); i < 0 || i != len(w.log)-1 {
		w.t.Errorf("writes and calls %q, want none after %q", w.log, call)
	}
	select {
	case e := <-w.events.Events:
		w.t.Errorf("event %q, want none", e)
	default:
	}
}

// A CreateSnapshot the drain refused records nothing: no error on the content's status, no
// SnapshotCreationFailed event, no write at all after it. The being-created record stays
// for the next leader, which takes the snapshot.
func TestACreateSnapshotTheDrainRefusedRecordsNothing(t *testing.T) {
	w := newWorld(t, dynamicContent("c1"))
	w.driver.createErr = draintest.RefusedByDrain(t, "CreateSnapshot")
	if err := w.sync("c1"); !lifecycle.NotStarted(err) {
		t.Fatalf("sync: %v, want the refusal", err)
	}
	w.checkNothingRecorded("c1", "CreateSnapshot snapshot-uid-1")
	if _, ok := w.content("c1").Annotations[annBeingCreated]; !ok {
		t.Error("the being-created record was dropped: the next leader could not know a snapshot may exist")
	}

	// The next leader takes it.
	w.driver.createErr = nil
	waitFor(t, func() bool {
		c, _, _ := w.ctrl.own.Get("c1")
		_, creating := c.Annotations[annBeingCreated]
		return creating
	})
	if err := w.sync("c1"); err != nil {
		t.Fatal(err)
	}
	if c := w.content("c1"); !isReady(c) || c.Status.Error != nil {
		t.Errorf("status after the next leader's CreateSnapshot %+v, want ready without an error", c.Status)
	}
}

// Asking again whether a snapshot is ready (CreateSnapshot repeated, or ListSnapshots for a
// pre-provisioned one) and being refused records nothing either.
func TestAReadinessCheckTheDrainRefusedRecordsNothing(t *testing.T) {
	handle, notReady := "id-snapshot-uid-1", false
	taken := dynamicContent("taken")
	taken.Status = &snapv1.VolumeSnapshotContentStatus{SnapshotHandle: &handle, ReadyToUse: &notReady}
	w := newWorld(t, taken, preProvisionedContent("pre", "backend-snap"))
	w.driver.createErr = draintest.RefusedByDrain(t, "CreateSnapshot")
	w.driver.listErr = draintest.RefusedByDrain(t, "ListSnapshots")
	if err := w.sync("taken"); !lifecycle.NotStarted(err) {
		t.Fatalf("sync of a snapshot not ready yet: %v, want the refusal", err)
	}
	w.checkNothingRecorded("taken", "CreateSnapshot snapshot-uid-1")
	if err := w.sync("pre"); !lifecycle.NotStarted(err) {
		t.Fatalf("sync of a pre-provisioned snapshot: %v, want the refusal", err)
	}
	w.checkNothingRecorded("pre", "ListSnapshots backend-snap")
}

// A DeleteSnapshot the drain refused records nothing: no SnapshotDeleteError event, no
// error on the status, no write; the finalizer stays for the next leader, which deletes.
func TestADeleteSnapshotTheDrainRefusedRecordsNothing(t *testing.T) {
	c := dynamicContent("c1")
	now := metav1.Now()
	c.DeletionTimestamp = &now
	c.Annotations[annBeingDeleted] = "yes"
	ready, handle := true, "id-x"
	c.Status = &snapv1.VolumeSnapshotContentStatus{ReadyToUse: &ready, SnapshotHandle: &handle}
	w := newWorld(t, c)
	w.driver.created[handle] = &csi.Snapshot{SnapshotId: handle}
	w.driver.deleteErr = draintest.RefusedByDrain(t, "DeleteSnapshot")
	if err := w.sync("c1"); !lifecycle.NotStarted(err) {
		t.Fatalf("sync: %v, want the refusal", err)
	}
	w.checkNothingRecorded("c1", "DeleteSnapshot id-x")
	if !slices.Contains(w.content("c1").Finalizers, contentFinalizer) {
		t.Error("finalizer removed though the snapshot was not deleted")
	}

	// The next leader deletes it.
	w.driver.deleteErr = nil
	if err := w.sync("c1"); err != nil {
		t.Fatal(err)
	}
	if _, left := w.driver.created[handle]; left {
		t.Errorf("snapshot not deleted by the next sync: %q", w.log)
	}
}

// refusingGroupClient is the driver's group controller service as a draining replica's
// connection makes it: CreateVolumeGroupSnapshot is refused without reaching the driver.
// (The test driver's gRPC server cannot return the core's refusal with its type.)
type refusingGroupClient struct {
	csi.GroupControllerClient
	refusal error
}

func (r refusingGroupClient) CreateVolumeGroupSnapshot(context.Context, *csi.CreateVolumeGroupSnapshotRequest, ...grpc.CallOption) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	return nil, r.refusal
}

// A CreateVolumeGroupSnapshot the drain refused records nothing either: no error on the
// group content's status, no event, no write after the being-created record, which stays
// for the next leader; that leader takes the group snapshot.
func TestACreateVolumeGroupSnapshotTheDrainRefusedRecordsNothing(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{})
	v1ID, v2ID := f.volume("pv-1"), f.volume("pv-2")
	f.add(dynamicGroupContent("gc-1", v1ID, v2ID), groupClass(groupTestClass, groupTestDriver, nil), groupSecret(groupTestSecret, "token"))
	real := f.g.driver.group
	f.g.driver.group = refusingGroupClient{GroupControllerClient: real, refusal: draintest.RefusedByDrain(t, "CreateVolumeGroupSnapshot")}
	f.start()

	if err := f.sync("gc-1"); !lifecycle.NotStarted(err) {
		t.Fatalf("sync: %v, want the refusal", err)
	}
	got := f.stored("gc-1")
	if got.Status != nil && got.Status.Error != nil {
		t.Errorf("group content has error %q on its status, want none", *got.Status.Error.Message)
	}
	if !hasAnnotation(got, annGroupBeingCreated) {
		t.Error("the being-created record was dropped: the next leader could not know a group snapshot may exist")
	}
	if w := f.writes(); len(w) != 1 || !strings.Contains(w[0].body, annGroupBeingCreated) {
		t.Errorf("writes %+v, want only the being-created record", w)
	}
	if ev := f.events(); len(ev) != 0 {
		t.Errorf("events %q, want none", ev)
	}
	if n := len(f.driver.Calls(testdriver.MethodCreateVolumeGroupSnapshot)); n != 0 {
		t.Errorf("the driver saw %d CreateVolumeGroupSnapshot calls, want none", n)
	}

	// The next leader takes it.
	f.g.driver.group = real
	f.waitCached("gc-1", func(c *groupv1.VolumeGroupSnapshotContent) bool { return hasAnnotation(c, annGroupBeingCreated) })
	if err := f.sync("gc-1"); err != nil {
		t.Fatal(err)
	}
	if got := f.stored("gc-1"); !groupReady(got) || got.Status.Error != nil || hasAnnotation(got, annGroupBeingCreated) {
		t.Errorf("after the next leader's call: status %+v, annotations %v; want ready, no error, no record", got.Status, got.Annotations)
	}
}
