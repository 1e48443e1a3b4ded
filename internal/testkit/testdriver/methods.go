package testdriver

// Method names as they appear in Call.Method, Fault.Method and the latency
// settings: the CSI RPC name without its service prefix.
const (
	MethodGetPluginInfo         = "GetPluginInfo"
	MethodGetPluginCapabilities = "GetPluginCapabilities"
	MethodProbe                 = "Probe"

	MethodCreateVolume               = "CreateVolume"
	MethodDeleteVolume               = "DeleteVolume"
	MethodControllerPublishVolume    = "ControllerPublishVolume"
	MethodControllerUnpublishVolume  = "ControllerUnpublishVolume"
	MethodControllerExpandVolume     = "ControllerExpandVolume"
	MethodControllerModifyVolume     = "ControllerModifyVolume"
	MethodValidateVolumeCapabilities = "ValidateVolumeCapabilities"
	MethodListVolumes                = "ListVolumes"
	MethodGetCapacity                = "GetCapacity"
	MethodControllerGetVolume        = "ControllerGetVolume"
	MethodControllerGetCapabilities  = "ControllerGetCapabilities"
	MethodControllerGetVolumeHealth  = "ControllerGetVolumeHealth"
	MethodControllerListVolumeHealth = "ControllerListVolumeHealth"
	MethodCreateSnapshot             = "CreateSnapshot"
	MethodDeleteSnapshot             = "DeleteSnapshot"
	MethodListSnapshots              = "ListSnapshots"
	MethodGetSnapshot                = "GetSnapshot"

	MethodGroupControllerGetCapabilities = "GroupControllerGetCapabilities"
	MethodCreateVolumeGroupSnapshot      = "CreateVolumeGroupSnapshot"
	MethodDeleteVolumeGroupSnapshot      = "DeleteVolumeGroupSnapshot"
	MethodGetVolumeGroupSnapshot         = "GetVolumeGroupSnapshot"

	MethodNodeGetInfo         = "NodeGetInfo"
	MethodNodeGetCapabilities = "NodeGetCapabilities"
	MethodNodeStageVolume     = "NodeStageVolume"
	MethodNodeUnstageVolume   = "NodeUnstageVolume"
	MethodNodePublishVolume   = "NodePublishVolume"
	MethodNodeUnpublishVolume = "NodeUnpublishVolume"
)

// usesBackendLatency reports whether Config.Latency applies to method. Only
// the Controller and GroupController RPCs that talk to the storage backend are
// slow by default; identity, capability and node RPCs answer from local
// knowledge.
func usesBackendLatency(method string) bool {
	switch method {
	case MethodCreateVolume, MethodDeleteVolume,
		MethodControllerPublishVolume, MethodControllerUnpublishVolume,
		MethodControllerExpandVolume, MethodControllerModifyVolume,
		MethodValidateVolumeCapabilities, MethodListVolumes,
		MethodGetCapacity, MethodControllerGetVolume,
		MethodControllerGetVolumeHealth, MethodControllerListVolumeHealth,
		MethodCreateSnapshot, MethodDeleteSnapshot, MethodListSnapshots,
		MethodGetSnapshot, MethodCreateVolumeGroupSnapshot,
		MethodDeleteVolumeGroupSnapshot, MethodGetVolumeGroupSnapshot:
		return true
	}
	return false
}

// isMutating reports whether method changes backend state, which is what the
// overlap detector watches.
func isMutating(method string) bool {
	switch method {
	case MethodCreateVolume, MethodDeleteVolume,
		MethodControllerPublishVolume, MethodControllerUnpublishVolume,
		MethodControllerExpandVolume, MethodControllerModifyVolume,
		MethodCreateSnapshot, MethodDeleteSnapshot,
		MethodCreateVolumeGroupSnapshot, MethodDeleteVolumeGroupSnapshot:
		return true
	}
	return false
}

// isSnapshotMethod reports whether method is about snapshots rather than
// volumes: its overlap keys are snapshot ids and names, never the source
// volume, since snapshotting a volume may overlap anything done to it.
func isSnapshotMethod(method string) bool {
	switch method {
	case MethodCreateSnapshot, MethodDeleteSnapshot,
		MethodCreateVolumeGroupSnapshot, MethodDeleteVolumeGroupSnapshot:
		return true
	}
	return false
}

// SidecarOf names the controller sidecar that makes a mutating call of method:
// "provisioner", "attacher", "resizer" or "snapshotter"; "" for any other method.
// Two sidecars may drive one volume at once (upstream's attacher may publish
// while its resizer modifies); one sidecar's calls on a volume must never
// overlap, whichever of its replicas made them.
func SidecarOf(method string) string {
	switch method {
	case MethodCreateVolume, MethodDeleteVolume:
		return "provisioner"
	case MethodControllerPublishVolume, MethodControllerUnpublishVolume:
		return "attacher"
	case MethodControllerExpandVolume, MethodControllerModifyVolume:
		return "resizer"
	case MethodCreateSnapshot, MethodDeleteSnapshot,
		MethodCreateVolumeGroupSnapshot, MethodDeleteVolumeGroupSnapshot:
		return "snapshotter"
	}
	return ""
}
