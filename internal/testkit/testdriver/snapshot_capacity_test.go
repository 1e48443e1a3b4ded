package testdriver_test

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func TestGetCapacityAnswersPerSegmentAndParametersAndFollowsRuleChanges(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{TotalCapacity: 8 << 20, CapacityRules: []testdriver.CapacityRule{
		{Segment: map[string]string{testdriver.TopologyKey: "a"}, Parameters: map[string]string{"type": "fast"}, AvailableCapacity: 100, MaximumVolumeSize: 50, MinimumVolumeSize: 10},
		{Segment: map[string]string{testdriver.TopologyKey: "a"}, AvailableCapacity: 200},
	}}, 1)
	c := d.ctrl(0)
	ask := func(node, typ string) *csi.GetCapacityResponse {
		t.Helper()
		req := &csi.GetCapacityRequest{Parameters: map[string]string{"type": typ}}
		if node != "" {
			req.AccessibleTopology = &csi.Topology{Segments: map[string]string{testdriver.TopologyKey: node}}
		}
		rsp, err := c.GetCapacity(ctx, req)
		if err != nil {
			t.Fatalf("GetCapacity(%s, %s): %v", node, typ, err)
		}
		return rsp
	}
	if r := ask("a", "fast"); r.GetAvailableCapacity() != 100 || r.GetMaximumVolumeSize().GetValue() != 50 || r.GetMinimumVolumeSize().GetValue() != 10 {
		t.Errorf("segment a, fast: %v", r)
	}
	if r := ask("a", "slow"); r.GetAvailableCapacity() != 200 || r.GetMaximumVolumeSize() != nil || r.GetMinimumVolumeSize() != nil {
		t.Errorf("segment a, slow: %v", r)
	}
	if r := ask("b", "fast"); r.GetAvailableCapacity() != 8<<20 {
		t.Errorf("segment b falls back to the pool: %v", r)
	}
	d.b.SetCapacityRules([]testdriver.CapacityRule{{AvailableCapacity: 7}})
	if r := ask("a", "fast"); r.GetAvailableCapacity() != 7 {
		t.Errorf("after SetCapacityRules: %v", r)
	}
}

func TestRestoresAVolumeFromASnapshotAtLeastAsLargeAsTheSnapshot(t *testing.T) {
	ctx := testCtx(t)
	caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)
	d := startDriver(t, testdriver.Config{ControllerCapabilities: caps}, 1)
	c := d.ctrl(0)
	src, err := c.CreateVolume(ctx, createReq("src", 4<<20))
	if err != nil {
		t.Fatal(err)
	}
	snap, err := d.b.TakeSnapshot("snap-1", src.GetVolume().GetVolumeId())
	if err != nil || snap.SizeBytes != 4<<20 {
		t.Fatalf("TakeSnapshot: %+v, %v", snap, err)
	}
	req := createReq("restored", 1<<20)
	req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.ID}}}
	rsp, err := c.CreateVolume(ctx, req)
	if err != nil || rsp.GetVolume().GetCapacityBytes() != 4<<20 || rsp.GetVolume().GetContentSource().GetSnapshot().GetSnapshotId() != snap.ID {
		t.Fatalf("restore: %v, %v", rsp, err)
	}
	req = createReq("missing", 1<<20)
	req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "snap-99999999"}}}
	_, err = c.CreateVolume(ctx, req)
	wantCode(t, "restore from a missing snapshot", err, codes.NotFound)

	d2 := startDriver(t, testdriver.Config{}, 1)
	_, err = d2.ctrl(0).CreateVolume(ctx, req)
	wantCode(t, "restore without CREATE_DELETE_SNAPSHOT", err, codes.InvalidArgument)
}
