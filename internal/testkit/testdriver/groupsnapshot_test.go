package testdriver_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func (d *driver) group(i int) csi.GroupControllerClient {
	return csi.NewGroupControllerClient(d.conns[i])
}

// services lists the plugin services GetPluginCapabilities advertises.
func services(ctx context.Context, t *testing.T, d *driver) []csi.PluginCapability_Service_Type {
	t.Helper()
	plugin, err := d.ident(0).GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		t.Fatalf("GetPluginCapabilities: %v", err)
	}
	var out []csi.PluginCapability_Service_Type
	for _, pc := range plugin.GetCapabilities() {
		if s := pc.GetService(); s != nil {
			out = append(out, s.GetType())
		}
	}
	return out
}

func TestGroupControllerComesWithSnapshots(t *testing.T) {
	ctx := testCtx(t)
	for _, tc := range []struct {
		name string
		cfg  testdriver.Config
		want bool
	}{
		{"default capabilities", testdriver.Config{}, false},
		{"snapshots", testdriver.Config{ControllerCapabilities: snapshotCaps()}, true},
		{"snapshots, group controller off", testdriver.Config{ControllerCapabilities: snapshotCaps(), DisableGroupController: true}, false},
		{"controller service off", testdriver.Config{ControllerCapabilities: snapshotCaps(), DisableControllerService: true}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startDriver(t, tc.cfg, 1)
			advertised := slices.Contains(services(ctx, t, d), csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE)
			caps, err := d.group(0).GroupControllerGetCapabilities(ctx, &csi.GroupControllerGetCapabilitiesRequest{})
			if !tc.want {
				if advertised {
					t.Error("GROUP_CONTROLLER_SERVICE advertised")
				}
				wantCode(t, "GroupControllerGetCapabilities", err, codes.Unimplemented)
				_, err = d.group(0).CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "g", SourceVolumeIds: []string{"vol-00000001"}})
				wantCode(t, "CreateVolumeGroupSnapshot", err, codes.Unimplemented)
				return
			}
			if !advertised {
				t.Error("GROUP_CONTROLLER_SERVICE not advertised")
			}
			if err != nil || len(caps.GetCapabilities()) != 1 ||
				caps.GetCapabilities()[0].GetRpc().GetType() != csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT {
				t.Errorf("GroupControllerGetCapabilities: %v, %v", caps, err)
			}
		})
	}
}

func TestVolumeGroupSnapshots(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps()}, 2)
	c, g := d.ctrl(0), d.group(0)
	a, b, other := mustCreate(ctx, t, c, "pvc-a"), mustCreate(ctx, t, c, "pvc-b"), mustCreate(ctx, t, c, "pvc-c")
	lone := mustSnapshot(ctx, t, c, "snapshot-lone", a)

	req := &csi.CreateVolumeGroupSnapshotRequest{Name: "group-1", SourceVolumeIds: []string{a, b}, Parameters: map[string]string{"p": "1"}}
	rsp, err := g.CreateVolumeGroupSnapshot(ctx, req)
	if err != nil {
		t.Fatalf("CreateVolumeGroupSnapshot: %v", err)
	}
	gs := rsp.GetGroupSnapshot()
	groupID := gs.GetGroupSnapshotId()
	if len(gs.GetSnapshots()) != 2 || !gs.GetReadyToUse() || gs.GetCreationTime() == nil {
		t.Fatalf("group snapshot %v", gs)
	}
	var members []string
	for i, s := range gs.GetSnapshots() {
		if s.GetGroupSnapshotId() != groupID || s.GetSourceVolumeId() != req.SourceVolumeIds[i] || !s.GetReadyToUse() {
			t.Errorf("member %d: %v", i, s)
		}
		members = append(members, s.GetSnapshotId())
	}

	// Backend view: the group, and its members among the snapshots.
	groups := d.b.GroupSnapshots()
	if len(groups) != 1 || groups[0].ID != groupID || groups[0].Name != "group-1" || !slices.Equal(groups[0].SnapshotIDs, members) ||
		!slices.Equal(groups[0].SourceVolumeIDs, []string{a, b}) || !groups[0].ReadyToUse {
		t.Errorf("GroupSnapshots %+v", groups)
	}
	var inGroup []string
	for _, s := range d.b.Snapshots() {
		if s.GroupSnapshotID == groupID {
			inGroup = append(inGroup, s.ID)
		}
	}
	if !slices.Equal(inGroup, members) {
		t.Errorf("snapshots tagged with %s: %v, want %v", groupID, inGroup, members)
	}

	// Idempotent by name, whatever the order of the volumes.
	again, err := d.group(1).CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "group-1", SourceVolumeIds: []string{b, a}, Parameters: map[string]string{"p": "1"}})
	if err != nil || again.GetGroupSnapshot().GetGroupSnapshotId() != groupID {
		t.Errorf("repeated CreateVolumeGroupSnapshot: %v, %v", again, err)
	}
	for _, conflict := range []*csi.CreateVolumeGroupSnapshotRequest{
		{Name: "group-1", SourceVolumeIds: []string{a, other}, Parameters: map[string]string{"p": "1"}},
		{Name: "group-1", SourceVolumeIds: []string{a, b}, Parameters: map[string]string{"p": "2"}},
	} {
		_, err := g.CreateVolumeGroupSnapshot(ctx, conflict)
		wantCode(t, "CreateVolumeGroupSnapshot of one name with other arguments", err, codes.AlreadyExists)
	}
	for _, bad := range []*csi.CreateVolumeGroupSnapshotRequest{
		{SourceVolumeIds: []string{a}},
		{Name: "group-2"},
		{Name: "group-2", SourceVolumeIds: []string{a, a}},
	} {
		_, err := g.CreateVolumeGroupSnapshot(ctx, bad)
		wantCode(t, "invalid CreateVolumeGroupSnapshot", err, codes.InvalidArgument)
	}
	_, err = g.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "group-2", SourceVolumeIds: []string{a, "vol-00000099"}})
	wantCode(t, "CreateVolumeGroupSnapshot of a missing volume", err, codes.NotFound)
	if n := len(d.b.Snapshots()); n != 3 {
		t.Errorf("%d snapshots after the failed creates, want 3: a failed group cuts nothing", n)
	}

	// Members are listed with their group.
	list, err := c.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: members[1]})
	if err != nil || len(list.GetEntries()) != 1 || list.GetEntries()[0].GetSnapshot().GetGroupSnapshotId() != groupID {
		t.Errorf("ListSnapshots of a member: %v, %v", list, err)
	}

	get, err := g.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: groupID, SnapshotIds: []string{members[1], members[0]}})
	if err != nil || len(get.GetGroupSnapshot().GetSnapshots()) != 2 {
		t.Errorf("GetVolumeGroupSnapshot: %v, %v", get, err)
	}
	_, err = g.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: groupID, SnapshotIds: []string{members[0], lone}})
	wantCode(t, "GetVolumeGroupSnapshot with other members", err, codes.InvalidArgument)
	_, err = g.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "group-00000099"})
	wantCode(t, "GetVolumeGroupSnapshot of a missing group", err, codes.NotFound)

	// Deleting needs the right members and takes them all.
	for _, ids := range [][]string{{members[0]}, {members[0], lone}, nil} {
		_, err = g.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: groupID, SnapshotIds: ids})
		wantCode(t, "DeleteVolumeGroupSnapshot with other members", err, codes.InvalidArgument)
	}
	for range 2 {
		if _, err := g.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: groupID, SnapshotIds: members}); err != nil {
			t.Errorf("DeleteVolumeGroupSnapshot: %v", err)
		}
	}
	if s := d.b.Snapshots(); len(s) != 1 || s[0].ID != lone {
		t.Errorf("snapshots after deleting the group: %+v", s)
	}
	if gs := d.b.GroupSnapshots(); len(gs) != 0 {
		t.Errorf("group snapshots after deleting: %+v", gs)
	}

	// The journal names groups like volumes: the name asked for, the id
	// made, the members.
	var got []string
	for _, call := range d.b.Journal() {
		switch call.Method {
		case testdriver.MethodCreateVolumeGroupSnapshot, testdriver.MethodDeleteVolumeGroupSnapshot:
			if call.Code == "OK" {
				got = append(got, call.Method+" "+call.GroupSnapshotName+" "+call.GroupSnapshotID+" "+call.SourceVolumeIDs+" "+call.SnapshotIDs)
			}
		}
	}
	joined := members[0] + "," + members[1]
	want := []string{
		"CreateVolumeGroupSnapshot group-1 " + groupID + " " + a + "," + b + " " + joined,
		"CreateVolumeGroupSnapshot group-1 " + groupID + " " + b + "," + a + " " + joined,
		"DeleteVolumeGroupSnapshot  " + groupID + "  " + joined,
		"DeleteVolumeGroupSnapshot  " + groupID + "  " + joined,
	}
	if !slices.Equal(got, want) {
		t.Errorf("journal:\n%q\nwant\n%q", got, want)
	}
}

func TestVolumeGroupSnapshotContinuesAfterCancelAndOverlaps(t *testing.T) {
	// The retry, on a connection not used yet, must start while the first call runs.
	const latency = time.Second
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps()}, 2)
	a, b := mustCreate(ctx, t, d.ctrl(0), "pvc-a"), mustCreate(ctx, t, d.ctrl(0), "pvc-b")
	d.b.SetMethodLatency(testdriver.MethodCreateVolumeGroupSnapshot, latency)

	callCtx, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() {
		_, err := d.group(0).CreateVolumeGroupSnapshot(callCtx, &csi.CreateVolumeGroupSnapshotRequest{Name: "group-1", SourceVolumeIds: []string{a, b}})
		errc <- err
	}()
	if err := d.b.WaitFor(ctx, startedCalls(testdriver.MethodCreateVolumeGroupSnapshot, 1)); err != nil {
		t.Fatal(err)
	}
	cancel()
	wantCode(t, "abandoned CreateVolumeGroupSnapshot", <-errc, codes.Canceled)
	// The new leader retries on another socket while the first still runs.
	rsp, err := d.group(1).CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "group-1", SourceVolumeIds: []string{a, b}})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.b.WaitFor(ctx, doneCalls(testdriver.MethodCreateVolumeGroupSnapshot, 2)); err != nil {
		t.Fatal(err)
	}
	first := callsOf(d.b.Journal(), testdriver.MethodCreateVolumeGroupSnapshot)[0]
	if !first.Canceled || first.Code != "OK" || first.GroupSnapshotID != rsp.GetGroupSnapshot().GetGroupSnapshotId() {
		t.Errorf("abandoned create %+v, want it to have cut %s", first, rsp.GetGroupSnapshot().GetGroupSnapshotId())
	}
	if n := len(d.b.GroupSnapshots()); n != 1 {
		t.Errorf("%d group snapshots, want 1", n)
	}
	o := d.b.Overlaps()
	if len(o) != 1 || o[0].Volume != "group-name:group-1" {
		t.Errorf("overlaps %+v, want the two creates of group-1", o)
	}
}

func TestVolumeGroupSnapshotReadiness(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: snapshotCaps(), SnapshotReadyAfterPolls: 2}, 1)
	a, b := mustCreate(ctx, t, d.ctrl(0), "pvc-a"), mustCreate(ctx, t, d.ctrl(0), "pvc-b")
	rsp, err := d.group(0).CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "group-1", SourceVolumeIds: []string{a, b}})
	if err != nil {
		t.Fatal(err)
	}
	id := rsp.GetGroupSnapshot().GetGroupSnapshotId()
	ready := []bool{rsp.GetGroupSnapshot().GetReadyToUse()}
	for range 2 {
		get, err := d.group(0).GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: id})
		if err != nil {
			t.Fatal(err)
		}
		ready = append(ready, get.GetGroupSnapshot().GetReadyToUse())
	}
	if want := []bool{false, false, true}; !slices.Equal(ready, want) {
		t.Errorf("ready_to_use in create, get, get: %v, want %v", ready, want)
	}

	rsp, err = d.group(0).CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "group-2", SourceVolumeIds: []string{a}})
	if err != nil || rsp.GetGroupSnapshot().GetReadyToUse() {
		t.Fatalf("CreateVolumeGroupSnapshot: %v, %v", rsp, err)
	}
	id = rsp.GetGroupSnapshot().GetGroupSnapshotId()
	if !d.b.MarkSnapshotReady(id) {
		t.Fatal("MarkSnapshotReady of a group")
	}
	if g, _ := d.b.GroupSnapshot(id); !g.ReadyToUse {
		t.Errorf("group after MarkSnapshotReady: %+v", g)
	}
}
