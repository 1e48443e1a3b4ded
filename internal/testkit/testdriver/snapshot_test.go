package testdriver_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/logtest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// snapshotCaps are the default capabilities plus every snapshot capability.
func snapshotCaps() []csi.ControllerServiceCapability_RPC_Type {
	return append(testdriver.DefaultControllerCapabilities(),
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_GET_SNAPSHOT)
}

func snapReq(name, volumeID string) *csi.CreateSnapshotRequest {
	return &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: volumeID}
}

// mustSnapshot cuts a snapshot and returns its id.
func mustSnapshot(ctx context.Context, t *testing.T, c csi.ControllerClient, name, volumeID string) string {
	t.Helper()
	rsp, err := c.CreateSnapshot(ctx, snapReq(name, volumeID))
	if err != nil {
		t.Fatalf("CreateSnapshot %s: %v", name, err)
	}
	return rsp.GetSnapshot().GetSnapshotId()
}

func TestSnapshotOperationsContinueAfterCancel(t *testing.T) {
	// The cancel must reach the driver while the call runs, on a loaded machine too.
	const latency = time.Second
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps()}, 1)
	c := d.ctrl(0)
	vol := mustCreate(ctx, t, c, "pvc-1")
	d.b.SetMethodLatency(testdriver.MethodCreateSnapshot, latency)
	d.b.SetMethodLatency(testdriver.MethodDeleteSnapshot, latency)

	// abandon starts call, cancels it once the driver has it, and returns
	// its journal entry when the backend operation has ended.
	abandon := func(method string, call func(context.Context) error) testdriver.Call {
		t.Helper()
		callCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		errc := make(chan error, 1)
		go func() { errc <- call(callCtx) }()
		if err := d.b.WaitFor(ctx, startedCalls(method, 1)); err != nil {
			t.Fatal(err)
		}
		cancel()
		wantCode(t, method, <-errc, codes.Canceled)
		if err := d.b.WaitFor(ctx, doneCalls(method, 1)); err != nil {
			t.Fatal(err)
		}
		return callsOf(d.b.Journal(), method)[0]
	}

	create := abandon(testdriver.MethodCreateSnapshot, func(ctx context.Context) error {
		_, err := c.CreateSnapshot(ctx, snapReq("snapshot-1", vol))
		return err
	})
	snaps := d.b.Snapshots()
	if len(snaps) != 1 || snaps[0].Name != "snapshot-1" || snaps[0].SourceVolumeID != vol {
		t.Fatalf("snapshots after the abandoned create: %+v", snaps)
	}
	if !create.Canceled || create.Code != "OK" || create.SnapshotID != snaps[0].ID || create.SnapshotName != "snapshot-1" || create.VolumeID != vol {
		t.Errorf("journal entry of the abandoned create: %+v", create)
	}

	del := abandon(testdriver.MethodDeleteSnapshot, func(ctx context.Context) error {
		_, err := c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snaps[0].ID})
		return err
	})
	if !del.Canceled || del.Code != "OK" || del.SnapshotID != snaps[0].ID || del.End.Sub(del.Start) < latency {
		t.Errorf("journal entry of the abandoned delete: %+v", del)
	}
	if s := d.b.Snapshots(); len(s) != 0 {
		t.Errorf("snapshots after the abandoned delete: %+v", s)
	}
}

func TestCreateSnapshotIsIdempotentByName(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps()}, 2)
	a, b := mustCreate(ctx, t, d.ctrl(0), "pvc-a"), mustCreate(ctx, t, d.ctrl(0), "pvc-b")
	first := mustSnapshot(ctx, t, d.ctrl(0), "snapshot-1", a)
	if again := mustSnapshot(ctx, t, d.ctrl(1), "snapshot-1", a); again != first {
		t.Errorf("second CreateSnapshot of one name and source: %s, want %s", again, first)
	}
	_, err := d.ctrl(0).CreateSnapshot(ctx, snapReq("snapshot-1", b))
	wantCode(t, "CreateSnapshot of one name from another volume", err, codes.AlreadyExists)
	_, err = d.ctrl(0).CreateSnapshot(ctx, snapReq("snapshot-2", "vol-00000099"))
	wantCode(t, "CreateSnapshot of a missing volume", err, codes.NotFound)
	if s := d.b.Snapshots(); len(s) != 1 {
		t.Errorf("snapshots %+v, want only %s", s, first)
	}
	creates := callsOf(d.b.Journal(), testdriver.MethodCreateSnapshot)
	var got []string
	for _, c := range creates {
		got = append(got, c.SnapshotName+"="+c.SnapshotID+":"+c.Code)
	}
	want := []string{"snapshot-1=" + first + ":OK", "snapshot-1=" + first + ":OK", "snapshot-1=:AlreadyExists", "snapshot-2=:NotFound"}
	if !slices.Equal(got, want) {
		t.Errorf("journaled creates %v, want %v", got, want)
	}
}

func TestSnapshotOverlaps(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps()}, 2)
	vol := mustCreate(ctx, t, d.ctrl(0), "pvc-1")

	// Two snapshots of one volume, and a publish of it, at the same time
	// are no overlap.
	d.b.SetMethodLatency(testdriver.MethodCreateSnapshot, time.Second) // overlaps must happen on a loaded machine too
	var wg sync.WaitGroup
	for i, name := range []string{"snapshot-a", "snapshot-b"} {
		wg.Go(func() { mustSnapshot(ctx, t, d.ctrl(i), name, vol) })
	}
	if err := d.b.WaitFor(ctx, startedCalls(testdriver.MethodCreateSnapshot, 2)); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ctrl(0).ControllerPublishVolume(ctx, publishReq(vol, "node-a", false)); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if o := d.b.Overlaps(); len(o) != 0 {
		t.Fatalf("overlaps of snapshots of one volume: %+v", o)
	}

	// A retried CreateSnapshot overlaps the first by name; a DeleteSnapshot
	// of what it creates overlaps it by id.
	for i := range 2 {
		wg.Go(func() { mustSnapshot(ctx, t, d.ctrl(i), "snapshot-c", vol) })
		if err := d.b.WaitFor(ctx, startedCalls(testdriver.MethodCreateSnapshot, 3+i)); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	id := callsOf(d.b.Journal(), testdriver.MethodCreateSnapshot)[2].SnapshotID
	wg.Go(func() { mustSnapshot(ctx, t, d.ctrl(0), "snapshot-c", vol) })
	if err := d.b.WaitFor(ctx, startedCalls(testdriver.MethodCreateSnapshot, 5)); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ctrl(1).DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
		t.Fatal(err)
	}
	wg.Wait()

	var got []string
	for _, o := range d.b.Overlaps() {
		got = append(got, o.Volume+" "+o.First.Method+"/"+o.Second.Method)
	}
	want := []string{
		"snapshot-name:snapshot-c CreateSnapshot/CreateSnapshot",
		id + " CreateSnapshot/DeleteSnapshot",
	}
	if !slices.Equal(got, want) {
		t.Errorf("overlaps %q, want %q", got, want)
	}
	// The create that overlapped the delete ended after it and cut the
	// snapshot anew: a leak a test finds in Snapshots().
	recut := callsOf(d.b.Journal(), testdriver.MethodCreateSnapshot)[4].SnapshotID
	if s, ok := d.b.Snapshot(recut); !ok || recut == id || s.Name != "snapshot-c" {
		t.Errorf("snapshot %s cut by the create across the delete of %s: %+v", recut, id, s)
	}
}

func TestSnapshotFaults(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps()}, 1)
	c := d.ctrl(0)
	vol := mustCreate(ctx, t, c, "pvc-1")
	for _, f := range []testdriver.Fault{
		{Method: testdriver.MethodCreateSnapshot, Snapshot: "snapshot-b", Code: codes.Unavailable, Times: 1},
		{Method: testdriver.MethodCreateSnapshot, Snapshot: "snapshot-lost", Code: codes.DeadlineExceeded, ApplyAnyway: true, Times: 1},
	} {
		if err := d.b.InjectFault(f); err != nil {
			t.Fatal(err)
		}
	}
	a := mustSnapshot(ctx, t, c, "snapshot-a", vol)
	_, err := c.CreateSnapshot(ctx, snapReq("snapshot-b", vol))
	wantCode(t, "faulty CreateSnapshot", err, codes.Unavailable)
	if len(d.b.Snapshots()) != 1 {
		t.Errorf("snapshots after a failed create: %+v", d.b.Snapshots())
	}
	mustSnapshot(ctx, t, c, "snapshot-b", vol)
	_, err = c.CreateSnapshot(ctx, snapReq("snapshot-lost", vol))
	wantCode(t, "CreateSnapshot whose answer is lost", err, codes.DeadlineExceeded)
	if s := d.b.Snapshots(); len(s) != 3 || s[2].Name != "snapshot-lost" {
		t.Errorf("snapshots after a create whose answer was lost: %+v", s)
	}

	if err := d.b.InjectFault(testdriver.Fault{Method: testdriver.MethodDeleteSnapshot, Snapshot: a, Code: codes.Internal}); err != nil {
		t.Fatal(err)
	}
	_, err = c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: a})
	wantCode(t, "faulty DeleteSnapshot", err, codes.Internal)
	d.b.ClearFaults()
	if _, err := c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: a}); err != nil {
		t.Errorf("DeleteSnapshot after ClearFaults: %v", err)
	}
}

func TestSnapshotReadyAfterPolls(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps(), SnapshotReadyAfterPolls: 3}, 1)
	c := d.ctrl(0)
	vol := mustCreate(ctx, t, c, "pvc-1")
	var ready []bool
	rsp, err := c.CreateSnapshot(ctx, snapReq("snapshot-1", vol))
	if err != nil {
		t.Fatal(err)
	}
	id := rsp.GetSnapshot().GetSnapshotId()
	ready = append(ready, rsp.GetSnapshot().GetReadyToUse())
	// Looking from the test does not count as a poll.
	if s, _ := d.b.Snapshot(id); s.ReadyToUse {
		t.Errorf("snapshot ready before any poll: %+v", s)
	}
	list, err := c.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: id})
	if err != nil || len(list.GetEntries()) != 1 {
		t.Fatalf("ListSnapshots: %v, %v", list, err)
	}
	ready = append(ready, list.GetEntries()[0].GetSnapshot().GetReadyToUse())
	rsp, err = c.CreateSnapshot(ctx, snapReq("snapshot-1", vol))
	if err != nil {
		t.Fatal(err)
	}
	ready = append(ready, rsp.GetSnapshot().GetReadyToUse())
	get, err := c.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: id})
	if err != nil {
		t.Fatal(err)
	}
	ready = append(ready, get.GetSnapshot().GetReadyToUse())
	if want := []bool{false, false, false, true}; !slices.Equal(ready, want) {
		t.Errorf("ready_to_use in create, list, create, get: %v, want %v", ready, want)
	}
	if s, _ := d.b.Snapshot(id); !s.ReadyToUse {
		t.Errorf("snapshot after the polls: %+v", s)
	}

	other := mustSnapshot(ctx, t, c, "snapshot-2", vol)
	if !d.b.MarkSnapshotReady(other) || d.b.MarkSnapshotReady("snap-99999999") {
		t.Error("MarkSnapshotReady reports the wrong snapshots as existing")
	}
	get, err = c.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: other})
	if err != nil || !get.GetSnapshot().GetReadyToUse() {
		t.Errorf("GetSnapshot after MarkSnapshotReady: %v, %v", get, err)
	}
	_, err = c.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: "snap-99999999"})
	wantCode(t, "GetSnapshot of a missing snapshot", err, codes.NotFound)
}

func TestSnapshotReadyAfterTime(t *testing.T) {
	const after = 150 * time.Millisecond
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps(), SnapshotReadyAfter: after}, 1)
	c := d.ctrl(0)
	vol := mustCreate(ctx, t, c, "pvc-1")
	rsp, err := c.CreateSnapshot(ctx, snapReq("snapshot-1", vol))
	if err != nil || rsp.GetSnapshot().GetReadyToUse() {
		t.Fatalf("CreateSnapshot: %v, %v; want a snapshot not ready yet", rsp, err)
	}
	time.Sleep(after)
	list, err := c.ListSnapshots(ctx, &csi.ListSnapshotsRequest{})
	if err != nil || len(list.GetEntries()) != 1 || !list.GetEntries()[0].GetSnapshot().GetReadyToUse() {
		t.Errorf("ListSnapshots %v after the ready time: %v, %v", after, list, err)
	}
}

func TestSnapshotSecretKeysAreJournaled(t *testing.T) {
	ctx := testCtx(t)
	var buf logtest.Buffer
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps(), JournalWriter: &buf}, 1)
	c := d.ctrl(0)
	vol := mustCreate(ctx, t, c, "pvc-1")
	const value = "top-secret-value"
	req := snapReq("snapshot-1", vol)
	req.Secrets = map[string]string{"user": value, "password": value}
	rsp, err := c.CreateSnapshot(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	id := rsp.GetSnapshot().GetSnapshotId()
	if _, err := c.ListSnapshots(ctx, &csi.ListSnapshotsRequest{Secrets: map[string]string{"list-user": value}}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: id, Secrets: map[string]string{"delete-user": value}}); err != nil {
		t.Fatal(err)
	}
	// A rejected call is journaled with its secret keys too.
	_, err = c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{Secrets: map[string]string{"delete-user": value}})
	wantCode(t, "DeleteSnapshot without an id", err, codes.InvalidArgument)

	got := map[string][]string{}
	for _, call := range d.b.Journal() {
		got[call.Method] = append(got[call.Method], call.SecretKeys)
	}
	want := map[string][]string{
		testdriver.MethodCreateVolume:   {""},
		testdriver.MethodCreateSnapshot: {"password,user"},
		testdriver.MethodListSnapshots:  {"list-user"},
		testdriver.MethodDeleteSnapshot: {"delete-user", "delete-user"},
	}
	for m, keys := range want {
		if !slices.Equal(got[m], keys) {
			t.Errorf("secret keys of %s: %q, want %q", m, got[m], keys)
		}
	}
	if keys := callsOf(d.b.Journal(), testdriver.MethodCreateSnapshot)[0].SecretKeyList(); !slices.Equal(keys, []string{"password", "user"}) {
		t.Errorf("SecretKeyList %q", keys)
	}
	if bytes.Contains(buf.Bytes(), []byte(value)) {
		t.Error("the JSON journal holds a secret value")
	}
	sc := bufio.NewScanner(bytes.NewReader(buf.Bytes()))
	for sc.Scan() {
		var call testdriver.Call
		if err := json.Unmarshal(sc.Bytes(), &call); err != nil {
			t.Fatal(err)
		}
		if call.Method == testdriver.MethodCreateSnapshot && (call.SecretKeys != "password,user" || call.SnapshotID != id) {
			t.Errorf("JSON journal line %s", sc.Text())
		}
	}
}

func TestDeleteSnapshotRefusesGroupMembers(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps()}, 1)
	vol := mustCreate(ctx, t, d.ctrl(0), "pvc-1")
	g, err := d.b.TakeGroupSnapshot("group-1", []string{vol})
	if err != nil {
		t.Fatal(err)
	}
	_, err = d.ctrl(0).DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: g.SnapshotIDs[0]})
	wantCode(t, "DeleteSnapshot of a group member", err, codes.InvalidArgument)
	if !strings.Contains(callsOf(d.b.Journal(), testdriver.MethodDeleteSnapshot)[0].Message, g.ID) {
		t.Errorf("journal %+v", d.b.Journal())
	}
	if s, ok := d.b.Snapshot(g.SnapshotIDs[0]); !ok || s.Name != "" || s.GroupSnapshotID != g.ID || s.SourceVolumeID != vol {
		t.Errorf("group member %+v", s)
	}
}
