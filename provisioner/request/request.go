// The parts of a claim's CreateVolume request: the volume's name, size,
// capabilities and parameters.

package request

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/accessmodes"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Keys of StorageClass parameters that are for the provisioner, not the driver.
const (
	FSTypeKey = csiParameterPrefix + "fstype"
	// legacyFSTypeKey is matched case-insensitively and, not being prefixed, still passed
	// to the driver, as upstream does.
	legacyFSTypeKey = "fstype"

	// Extra metadata keys added to the parameters with --extra-create-metadata.
	pvcNameKey      = csiParameterPrefix + "pvc/name"
	pvcNamespaceKey = csiParameterPrefix + "pvc/namespace"
	pvNameKey       = csiParameterPrefix + "pv/name"

	// ProvisionerIDKey is the volume attribute naming the provisioner instance that
	// created a volume, as upstream.
	ProvisionerIDKey = "storage.kubernetes.io/csiProvisionerIdentity"
)

// VolumeName is the name of the volume and of its PersistentVolume: <prefix>-<claim UID>,
// or with uuidLength > 0 the UID without dashes cut to that length, as upstream.
func VolumeName(prefix string, uid types.UID, uuidLength int) (string, error) {
	if prefix == "" {
		return "", fmt.Errorf("volume name prefix cannot be empty")
	}
	if uid == "" {
		return "", fmt.Errorf("claim has no UID")
	}
	if uuidLength == -1 {
		return prefix + "-" + string(uid), nil
	}
	compact := strings.ReplaceAll(string(uid), "-", "")
	if uuidLength < 1 || uuidLength > len(compact) {
		return "", fmt.Errorf("volume name UUID length %d is outside 1..%d", uuidLength, len(compact))
	}
	return prefix + "-" + compact[:uuidLength], nil
}

// RequestedBytes is the claim's storage request in bytes, rounded up to a whole byte
// (Quantity.Value), as upstream sends it in the capacity range.
func RequestedBytes(claim *v1.PersistentVolumeClaim) int64 {
	q := claim.Spec.Resources.Requests[v1.ResourceStorage]
	return q.Value()
}

// FSTypeFor picks the file system from the StorageClass parameters (the prefixed key or
// the legacy "fstype" key, never both), else the default.
func FSTypeFor(params map[string]string, defaultFSType string) (string, error) {
	found := 0
	fsType := ""
	for k, v := range params {
		if k == FSTypeKey || strings.EqualFold(k, legacyFSTypeKey) {
			fsType = v
			found++
		}
	}
	if found > 1 {
		return "", fmt.Errorf("fstype specified in parameters with both %q and %q keys", legacyFSTypeKey, FSTypeKey)
	}
	if fsType == "" {
		fsType = defaultFSType
	}
	return fsType, nil
}

// IsBlock tells whether the claim asks for a raw block volume.
func IsBlock(claim *v1.PersistentVolumeClaim) bool {
	return claim.Spec.VolumeMode != nil && *claim.Spec.VolumeMode == v1.PersistentVolumeBlock
}

// VolumeCapabilities makes one capability per access mode of the claim: block, or mount
// with the file system and the StorageClass's mount options.
func VolumeCapabilities(claim *v1.PersistentVolumeClaim, fsType string, mountOptions []string, singleNodeMultiWriter bool) ([]*csi.VolumeCapability, error) {
	caps := make([]*csi.VolumeCapability, 0, len(claim.Spec.AccessModes))
	for _, m := range claim.Spec.AccessModes {
		mode, err := accessmodes.ToCSIAccessMode([]v1.PersistentVolumeAccessMode{m}, singleNodeMultiWriter)
		if err != nil {
			return nil, err
		}
		c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
		if IsBlock(claim) {
			c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		} else {
			c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType, MountFlags: mountOptions}}
		}
		caps = append(caps, c)
	}
	return caps, nil
}

// isKnownPrefixedKey tells whether k is a csi.storage.k8s.io/ parameter the provisioner
// understands.
func isKnownPrefixedKey(k string) bool {
	if k == FSTypeKey {
		return true
	}
	for _, s := range append(allSecrets(), DefaultSecret) {
		if k == s.NameKey || k == s.NamespaceKey {
			return true
		}
	}
	return false
}

// DriverParameters are the StorageClass parameters the driver gets: the csi.storage.k8s.io/
// keys are the provisioner's and are removed; an unknown key with that prefix is an error,
// because it is most likely a typo the user should hear about.
func DriverParameters(params map[string]string) (map[string]string, error) {
	out := make(map[string]string, len(params))
	for k, v := range params {
		if !strings.HasPrefix(k, csiParameterPrefix) {
			out[k] = v
			continue
		}
		if !isKnownPrefixedKey(k) {
			return nil, fmt.Errorf("found unknown parameter key %q with reserved namespace %s", k, csiParameterPrefix)
		}
	}
	return out, nil
}

// AddExtraMetadata adds the claim's and the PersistentVolume's names to the parameters
// (--extra-create-metadata).
func AddExtraMetadata(params map[string]string, claim *v1.PersistentVolumeClaim, pvName string) {
	params[pvcNameKey] = claim.Name
	params[pvcNamespaceKey] = claim.Namespace
	params[pvNameKey] = pvName
}

// PVCapacity is the capacity to record: the driver's, or the request when the driver does
// not know (0). Less than requested is an error: the volume does not fit the claim.
func PVCapacity(reported, requested int64) (int64, error) {
	switch {
	case reported == 0:
		return requested, nil
	case reported < requested:
		return 0, fmt.Errorf("created volume capacity %d less than requested capacity %d", reported, requested)
	}
	return reported, nil
}

// CheckCapabilities says why the driver cannot provision this claim, as upstream words it.
func CheckCapabilities(plugin rpc.PluginCapabilitySet, controller rpc.ControllerCapabilitySet, needsModify bool) error {
	switch {
	case !plugin[csi.PluginCapability_Service_CONTROLLER_SERVICE]:
		return errors.New("CSI driver does not support dynamic provisioning: plugin CONTROLLER_SERVICE capability is not reported")
	case !controller[csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME]:
		return errors.New("CSI driver does not support dynamic provisioning: controller CREATE_DELETE_VOLUME capability is not reported")
	case needsModify && !controller[csi.ControllerServiceCapability_RPC_MODIFY_VOLUME]:
		return errors.New("CSI driver does not support VolumeAttributesClass: controller MODIFY_VOLUME capability is not reported")
	}
	return nil
}

// WithFinalizer returns finalizers with f added or removed, and whether that changed them.
func WithFinalizer(finalizers []string, f string, add bool) ([]string, bool) {
	has := slices.Contains(finalizers, f)
	switch {
	case add && !has:
		return append(slices.Clone(finalizers), f), true
	case !add && has:
		return slices.DeleteFunc(slices.Clone(finalizers), func(x string) bool { return x == f }), true
	}
	return finalizers, false
}

// WaitsForFirstConsumer says whether the class binds late (WaitForFirstConsumer): its
// claims are provisioned for the node the scheduler selects, and the scheduler reads
// capacity for them.
func WaitsForFirstConsumer(class *storagev1.StorageClass) bool {
	return class.VolumeBindingMode != nil && *class.VolumeBindingMode == storagev1.VolumeBindingWaitForFirstConsumer
}
