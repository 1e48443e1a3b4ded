package request

import (
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/google/go-cmp/cmp"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	"google.golang.org/protobuf/testing/protocmp"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
)

func TestVolumeNameIsPrefixAndClaimUIDTruncatedOnlyWhenAsked(t *testing.T) {
	for _, tc := range []struct {
		name    string
		prefix  string
		uid     types.UID
		length  int
		want    string
		wantErr bool
	}{
		{name: "default keeps the UID with dashes", prefix: "pvc", uid: objects.UID, length: -1, want: "pvc-3f2a1b4c-5d6e-4f70-8192-a3b4c5d6e7f8"},
		{name: "length drops dashes and truncates", prefix: "pvc", uid: objects.UID, length: 16, want: "pvc-3f2a1b4c5d6e4f70"},
		{name: "full length without dashes", prefix: "vol", uid: objects.UID, length: 32, want: "vol-3f2a1b4c5d6e4f708192a3b4c5d6e7f8"},
		{name: "length beyond the UID is refused", prefix: "pvc", uid: objects.UID, length: 33, wantErr: true},
		{name: "zero length is refused", prefix: "pvc", uid: objects.UID, length: 0, wantErr: true},
		{name: "empty prefix is refused", prefix: "", uid: objects.UID, length: -1, wantErr: true},
		{name: "claim without UID is refused", prefix: "pvc", uid: "", length: -1, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := VolumeName(tc.prefix, tc.uid, tc.length)
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v, want error %v", err, tc.wantErr)
			}
			if got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestCapacityIsTheRequestRoundedUpToWholeBytesAndThePVGetsWhatTheDriverReports(t *testing.T) {
	for _, tc := range []struct {
		request   string
		reported  int64
		wantReq   int64
		wantPV    int64
		wantError bool
	}{
		{request: "1Gi", reported: 1 << 30, wantReq: 1 << 30, wantPV: 1 << 30},
		{request: "1G", reported: 0, wantReq: 1e9, wantPV: 1e9}, // 0: unknown, record the request
		{request: "1.5Gi", reported: 2 << 30, wantReq: 1610612736, wantPV: 2 << 30},
		{request: "100m", reported: 0, wantReq: 1, wantPV: 1}, // a tenth of a byte rounds up
		{request: "1500m", reported: 2, wantReq: 2, wantPV: 2},
		{request: "", reported: 5, wantReq: 0, wantPV: 5},
		{request: "2Gi", reported: 1 << 30, wantReq: 2 << 30, wantError: true}, // smaller than asked
	} {
		t.Run(tc.request, func(t *testing.T) {
			req := RequestedBytes(objects.ClaimWith(tc.request))
			if req != tc.wantReq {
				t.Errorf("requested %d bytes, want %d", req, tc.wantReq)
			}
			got, err := PVCapacity(tc.reported, req)
			if (err != nil) != tc.wantError {
				t.Fatalf("error %v, want error %v", err, tc.wantError)
			}
			if got != tc.wantPV {
				t.Errorf("PV capacity %d, want %d", got, tc.wantPV)
			}
		})
	}
}

func TestFSTypeComesFromThePrefixedOrLegacyKeyElseTheDefault(t *testing.T) {
	for _, tc := range []struct {
		name    string
		params  map[string]string
		def     string
		want    string
		wantErr bool
	}{
		{name: "prefixed key", params: map[string]string{FSTypeKey: "xfs"}, def: "ext4", want: "xfs"},
		{name: "legacy key any case", params: map[string]string{"FsType": "btrfs"}, want: "btrfs"},
		{name: "default", params: map[string]string{"other": "x"}, def: "ext4", want: "ext4"},
		{name: "none", params: nil, want: ""},
		{name: "both keys", params: map[string]string{FSTypeKey: "xfs", "fstype": "ext4"}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := FSTypeFor(tc.params, tc.def)
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v, want error %v", err, tc.wantErr)
			}
			if got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestVolumeCapabilitiesFollowAccessModesVolumeModeAndFSType(t *testing.T) {
	mount := func(mode csi.VolumeCapability_AccessMode_Mode, fs string, flags ...string) *csi.VolumeCapability {
		return &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fs, MountFlags: flags}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
		}
	}
	block := objects.ClaimWith("1Gi", v1.ReadWriteOnce)
	block.Spec.VolumeMode = ptr.To(v1.PersistentVolumeBlock)
	for _, tc := range []struct {
		name    string
		claim   *v1.PersistentVolumeClaim
		snmw    bool
		want    []*csi.VolumeCapability
		wantErr bool
	}{
		{name: "RWO mount", claim: objects.ClaimWith("1Gi", v1.ReadWriteOnce), want: []*csi.VolumeCapability{mount(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4", "noatime")}},
		{name: "RWO with single-node-multi-writer", claim: objects.ClaimWith("1Gi", v1.ReadWriteOnce), snmw: true, want: []*csi.VolumeCapability{mount(csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, "ext4", "noatime")}},
		{name: "one capability per mode", claim: objects.ClaimWith("1Gi", v1.ReadWriteMany, v1.ReadOnlyMany), want: []*csi.VolumeCapability{
			mount(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "ext4", "noatime"),
			mount(csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, "ext4", "noatime"),
		}},
		{name: "block ignores fs and mount options", claim: block, want: []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}}},
		{name: "RWOP maps to single writer without single-node-multi-writer", claim: objects.ClaimWith("1Gi", v1.ReadWriteOncePod), want: []*csi.VolumeCapability{mount(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "ext4", "noatime")}},
		{name: "RWOP with single-node-multi-writer", claim: objects.ClaimWith("1Gi", v1.ReadWriteOncePod), snmw: true, want: []*csi.VolumeCapability{mount(csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, "ext4", "noatime")}},
		{name: "unknown access mode is refused", claim: objects.ClaimWith("1Gi", "ReadSometimes"), wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := VolumeCapabilities(tc.claim, "ext4", []string{"noatime"}, tc.snmw)
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v, want error %v", err, tc.wantErr)
			}
			if diff := cmp.Diff(tc.want, got, protocmp.Transform()); diff != "" && !tc.wantErr {
				t.Errorf("capabilities (-want +got):\n%s", diff)
			}
		})
	}
}

func TestDriverParametersDropTheProvisionersKeysAndRefuseUnknownOnes(t *testing.T) {
	for _, tc := range []struct {
		name    string
		params  map[string]string
		want    map[string]string
		wantErr bool
	}{
		{name: "strips fstype and secrets, keeps legacy keys", params: map[string]string{
			"type": "fast", FSTypeKey: "xfs", "fstype": "ext4",
			ProvisionerSecret.NameKey: "s", ProvisionerSecret.NamespaceKey: "ns",
			DefaultSecret.NameKey: "d", DefaultSecret.NamespaceKey: "ns",
			NodeExpandSecret.NameKey: "e", NodeExpandSecret.NamespaceKey: "ns",
			ControllerModifySecret.NameKey: "m", ControllerModifySecret.NamespaceKey: "ns",
			"csiProvisionerSecretName": "old",
		}, want: map[string]string{"type": "fast", "fstype": "ext4", "csiProvisionerSecretName": "old"}},
		{name: "empty", params: nil, want: map[string]string{}},
		{name: "unknown reserved key", params: map[string]string{csiParameterPrefix + "fs-type": "xfs"}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DriverParameters(tc.params)
			if (err != nil) != tc.wantErr {
				t.Fatalf("error %v, want error %v", err, tc.wantErr)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" && !tc.wantErr {
				t.Errorf("parameters (-want +got):\n%s", diff)
			}
		})
	}
	params := map[string]string{"type": "fast"}
	AddExtraMetadata(params, objects.ClaimWith("1Gi"), "pvc-x")
	want := map[string]string{"type": "fast", pvcNameKey: "data", pvcNamespaceKey: "ns", pvNameKey: "pvc-x"}
	if diff := cmp.Diff(want, params); diff != "" {
		t.Errorf("extra metadata (-want +got):\n%s", diff)
	}
}

func TestCapabilityChecksSayWhatIsMissing(t *testing.T) {
	plugin := rpc.PluginCapabilitySet{csi.PluginCapability_Service_CONTROLLER_SERVICE: true}
	full := rpc.ControllerCapabilitySet{csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME: true, csi.ControllerServiceCapability_RPC_MODIFY_VOLUME: true}
	for _, tc := range []struct {
		name       string
		plugin     rpc.PluginCapabilitySet
		controller rpc.ControllerCapabilitySet
		modify     bool
		want       string
	}{
		{"all there", plugin, full, true, ""},
		{"no controller service", rpc.PluginCapabilitySet{}, full, false, "does not support dynamic provisioning: plugin CONTROLLER_SERVICE"},
		{"no create/delete", plugin, rpc.ControllerCapabilitySet{}, false, "does not support dynamic provisioning: controller CREATE_DELETE_VOLUME"},
		{"no modify for a VAC", plugin, rpc.ControllerCapabilitySet{csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME: true}, true, "does not support VolumeAttributesClass"},
	} {
		err := CheckCapabilities(tc.plugin, tc.controller, tc.modify)
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
}
