package testdriver_test

import (
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func healthCaps() []csi.ControllerServiceCapability_RPC_Type {
	return append(testdriver.DefaultControllerCapabilities(),
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH)
}

func TestVolumeHealthGetAndSet(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: healthCaps()}, 1)
	c := d.ctrl(0)
	id := mustCreate(ctx, t, c, "pvc-1")

	get := func() []*csi.VolumeHealth_VolumeHealthEntry {
		t.Helper()
		rsp, err := c.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: id})
		if err != nil {
			t.Fatalf("ControllerGetVolumeHealth: %v", err)
		}
		if got := rsp.GetVolumeHealth().GetVolumeId(); got != id {
			t.Errorf("volume_id %q, want %q", got, id)
		}
		return rsp.GetVolumeHealth().GetHealthStatuses()
	}
	if got := get(); len(got) != 0 {
		t.Errorf("a new volume reports %v, want healthy", got)
	}

	conds := []testdriver.HealthCondition{
		{Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: "PathDown", Message: "all paths down"},
		{Status: csi.VolumeHealthErrorType_DEGRADED, Reason: "ReplicaLost"},
	}
	if err := d.b.SetVolumeHealth(id, conds...); err != nil {
		t.Fatal(err)
	}
	got := get()
	if len(got) != 2 || got[0].GetStatus() != csi.VolumeHealthErrorType_INACCESSIBLE || got[0].GetReason() != "PathDown" ||
		got[0].GetMessage() != "all paths down" || got[1].GetStatus() != csi.VolumeHealthErrorType_DEGRADED || got[1].GetReason() != "ReplicaLost" {
		t.Errorf("abnormal volume reports %v", got)
	}
	if err := d.b.SetVolumeHealth(id); err != nil {
		t.Fatal(err)
	}
	if got := get(); len(got) != 0 {
		t.Errorf("a volume made healthy again reports %v", got)
	}

	// Arguments and state.
	_, err := c.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{})
	wantCode(t, "ControllerGetVolumeHealth without volume_id", err, codes.InvalidArgument)
	_, err = c.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: "vol-99999999"})
	wantCode(t, "ControllerGetVolumeHealth of an unknown volume", err, codes.NotFound)
	if err := d.b.SetVolumeHealth("vol-99999999", conds[0]); err == nil {
		t.Error("SetVolumeHealth of an unknown volume succeeded")
	}
	if err := d.b.SetVolumeHealth(id, conds[0], conds[0]); err == nil {
		t.Error("SetVolumeHealth with a repeated status and reason succeeded")
	}
	if err := d.b.SetVolumeHealth(id, testdriver.HealthCondition{Status: csi.VolumeHealthErrorType_DATA_LOSS}); err == nil {
		t.Error("SetVolumeHealth without a reason succeeded")
	}

	// Health goes with the volume.
	if err := d.b.SetVolumeHealth(id, conds[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
	if got := d.b.VolumeHealth(id); len(got) != 0 {
		t.Errorf("a deleted volume keeps its health %v", got)
	}
	if n := len(callsOf(d.b.Journal(), testdriver.MethodControllerGetVolumeHealth)); n != 5 {
		t.Errorf("journal holds %d ControllerGetVolumeHealth calls, want 5", n)
	}
}

func TestListVolumeHealthPages(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: healthCaps()}, 1)
	c := d.ctrl(0)
	var ids []string
	for i := range 7 {
		ids = append(ids, mustCreate(ctx, t, c, "pvc-"+string(rune('a'+i))))
	}
	// Volumes 1, 2, 4 and 6 are abnormal; only they are listed.
	abnormal := []string{ids[1], ids[2], ids[4], ids[6]}
	for _, id := range abnormal {
		if err := d.b.SetVolumeHealth(id, testdriver.HealthCondition{Status: csi.VolumeHealthErrorType_DEGRADED, Reason: "Slow"}); err != nil {
			t.Fatal(err)
		}
	}

	list := func(maxEntries int32, token string) (ids []string, next string) {
		t.Helper()
		rsp, err := c.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{MaxEntries: maxEntries, StartingToken: token})
		if err != nil {
			t.Fatalf("ControllerListVolumeHealth(%d, %q): %v", maxEntries, token, err)
		}
		for _, e := range rsp.GetEntries() {
			if len(e.GetHealthStatuses()) == 0 {
				t.Errorf("healthy volume %s listed", e.GetVolumeId())
			}
			ids = append(ids, e.GetVolumeId())
		}
		return ids, rsp.GetNextToken()
	}

	if got, next := list(0, ""); !slices.Equal(got, abnormal) || next != "" {
		t.Errorf("unpaged list: %v next %q, want %v", got, next, abnormal)
	}
	first, next := list(3, "")
	if !slices.Equal(first, abnormal[:3]) || next == "" {
		t.Fatalf("first page: %v next %q", first, next)
	}
	// Between pages the first volume of the next page turns healthy: the page boundary
	// stays put, and nothing listed is skipped.
	if err := d.b.SetVolumeHealth(abnormal[3]); err != nil {
		t.Fatal(err)
	}
	if got, next := list(3, next); len(got) != 0 || next != "" {
		t.Errorf("second page after the volume turned healthy: %v next %q", got, next)
	}
	// Pages of one, over the abnormal volumes left.
	var all []string
	token := ""
	for range 10 {
		page, next := list(1, token)
		all = append(all, page...)
		if token = next; token == "" {
			break
		}
	}
	if !slices.Equal(all, abnormal[:3]) {
		t.Errorf("pages of one listed %v, want %v", all, abnormal[:3])
	}

	// A driver that pages on its own: pages of two whatever the request asks.
	d2 := startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: healthCaps(), HealthPageSize: 2}, 1)
	for i := range 3 {
		id := mustCreate(ctx, t, d2.ctrl(0), "pvc-"+string(rune('a'+i)))
		if err := d2.b.SetVolumeHealth(id, testdriver.HealthCondition{Status: csi.VolumeHealthErrorType_DATA_LOSS, Reason: "Lost"}); err != nil {
			t.Fatal(err)
		}
	}
	rsp, err := d2.ctrl(0).ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{})
	if err != nil || len(rsp.GetEntries()) != 2 || rsp.GetNextToken() == "" {
		t.Errorf("a list of a driver with pages of two: %v, %v", rsp, err)
	}

	_, err = c.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{MaxEntries: -1})
	wantCode(t, "negative max_entries", err, codes.InvalidArgument)
	_, err = c.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{StartingToken: "bogus"})
	wantCode(t, "a token never issued", err, codes.Aborted)
}

func TestVolumeHealthCapabilities(t *testing.T) {
	ctx := testCtx(t)
	// The defaults advertise no health: both RPCs are Unimplemented.
	d := startDriver(t, testdriver.Config{Latency: fastLatency}, 1)
	c := d.ctrl(0)
	id := mustCreate(ctx, t, c, "pvc-1")
	_, err := c.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: id})
	wantCode(t, "ControllerGetVolumeHealth without GET_VOLUME_HEALTH", err, codes.Unimplemented)
	_, err = c.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{})
	wantCode(t, "ControllerListVolumeHealth without LIST_VOLUME_HEALTH", err, codes.Unimplemented)

	// GET alone: only ControllerListVolumeHealth is Unimplemented.
	d = startDriver(t, testdriver.Config{Latency: fastLatency, ControllerCapabilities: append(testdriver.DefaultControllerCapabilities(),
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH)}, 1)
	c = d.ctrl(0)
	id = mustCreate(ctx, t, c, "pvc-1")
	if _, err := c.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: id}); err != nil {
		t.Errorf("ControllerGetVolumeHealth with GET_VOLUME_HEALTH: %v", err)
	}
	_, err = c.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{})
	wantCode(t, "ControllerListVolumeHealth with GET_VOLUME_HEALTH only", err, codes.Unimplemented)

	// LIST without GET breaks the spec's rule.
	if _, err := testdriver.New(testdriver.Config{ControllerCapabilities: []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH}}); err == nil {
		t.Error("a config with LIST_VOLUME_HEALTH but not GET_VOLUME_HEALTH was accepted")
	}
}
