package testdriver_test

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// ControllerExpandVolume answers node_expansion_required as configured, per volume when
// overridden; the Node service advertises EXPAND_VOLUME only when asked to.
func TestNodeExpansionSwitches(t *testing.T) {
	for _, tc := range []struct {
		name         string
		cfg          testdriver.Config
		override     *bool
		wantRequired bool
		wantNodeCap  bool
	}{
		{name: "default: controller expansion is enough"},
		{name: "driver-wide node expansion", cfg: testdriver.Config{NodeExpansionRequired: true, NodeExpansion: true}, wantRequired: true, wantNodeCap: true},
		{name: "per-volume override on", override: ptrTo(true), wantRequired: true},
		{name: "per-volume override off", cfg: testdriver.Config{NodeExpansionRequired: true}, override: ptrTo(false)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			d := startDriver(t, tc.cfg, 1)
			id := mustCreate(ctx, t, d.ctrl(0), "vol")
			if tc.override != nil {
				d.b.SetNodeExpansionRequired(id, *tc.override)
			}
			rsp, err := d.ctrl(0).ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 20}})
			if err != nil {
				t.Fatalf("ControllerExpandVolume: %v", err)
			}
			if rsp.GetNodeExpansionRequired() != tc.wantRequired || rsp.GetCapacityBytes() != 2<<20 {
				t.Errorf("got required=%v capacity=%d, want required=%v capacity=%d", rsp.GetNodeExpansionRequired(), rsp.GetCapacityBytes(), tc.wantRequired, 2<<20)
			}
			caps, err := csi.NewNodeClient(d.conns[0]).NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
			if err != nil {
				t.Fatalf("NodeGetCapabilities: %v", err)
			}
			got := false
			for _, c := range caps.GetCapabilities() {
				got = got || c.GetRpc().GetType() == csi.NodeServiceCapability_RPC_EXPAND_VOLUME
			}
			if got != tc.wantNodeCap {
				t.Errorf("node EXPAND_VOLUME advertised: %v, want %v", got, tc.wantNodeCap)
			}
		})
	}
}

func ptrTo[T any](v T) *T { return &v }
