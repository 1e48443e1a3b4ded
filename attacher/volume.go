package attacher

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/accessmodes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Names upstream external-attacher uses; kept so a swap of images changes nothing (P9).
const (
	finalizerPrefix = "external-attacher/"
	// nodeIDAnnotation on a VolumeAttachment records the node ID it was published to, so
	// it can be unpublished when the CSINode is gone.
	nodeIDAnnotation = "csi.alpha.kubernetes.io/node-id"
	// nodeIDsAnnotation on a Node is the kubelet's older record of node IDs: a JSON map
	// from driver name to node ID.
	nodeIDsAnnotation = "csi.volume.kubernetes.io/nodeid"
	// migratedToAnnotation on an in-tree PV names the CSI driver it was migrated to.
	migratedToAnnotation = "pv.kubernetes.io/migrated-to"
)

// finalizerName is the finalizer the attacher of driver puts on VolumeAttachments and PVs.
func finalizerName(driver string) string {
	return finalizerPrefix + lifecycle.SanitizeName(driver)
}

// translator is the part of csi-translation-lib the attacher uses for in-tree volumes.
type translator interface {
	IsPVMigratable(pv *corev1.PersistentVolume) bool
	TranslateInTreePVToCSI(logger klog.Logger, pv *corev1.PersistentVolume) (*corev1.PersistentVolume, error)
	RepairVolumeHandle(driver, volumeHandle, nodeID string) (string, error)
}

// volume is what a VolumeAttachment asks to (un)publish, resolved from its PV (translated
// when it is an in-tree PV) or from its inline spec.
type volume struct {
	spec   *corev1.PersistentVolumeSpec
	source *corev1.CSIPersistentVolumeSource
	// migrated is set for an in-tree PV translated to CSI and for an inline spec (which
	// only exists for migrated in-tree inline volumes); the reconciler then repairs the
	// volume handle before comparing it with what the driver lists.
	migrated bool
}

var (
	errBothSources  = errors.New("both InlineCSIVolumeSource and PersistentVolumeName specified in VA source")
	errNoSource     = errors.New("neither InlineCSIVolumeSource nor PersistentVolumeName specified in VA source")
	errInlineNotCSI = errors.New("inline volume spec contains nil CSI source")
	errNotCSI       = errors.New("pv spec contained non-csi source that was not migrated")
)

// inlineVolume resolves an inline spec; ok is false when the VolumeAttachment names a PV.
func inlineVolume(va *storagev1.VolumeAttachment) (v *volume, ok bool, err error) {
	src := va.Spec.Source
	switch {
	case src.PersistentVolumeName != nil && src.InlineVolumeSpec != nil:
		return nil, true, errBothSources
	case src.PersistentVolumeName != nil:
		return nil, false, nil
	case src.InlineVolumeSpec == nil:
		return nil, true, errNoSource
	case src.InlineVolumeSpec.CSI == nil:
		return nil, true, errInlineNotCSI
	}
	return &volume{spec: src.InlineVolumeSpec, source: src.InlineVolumeSpec.CSI, migrated: true}, true, nil
}

// pvVolume resolves a PV, translating an in-tree one.
func pvVolume(logger klog.Logger, tr translator, pv *corev1.PersistentVolume) (*volume, error) {
	migrated := false
	if tr.IsPVMigratable(pv) {
		translated, err := tr.TranslateInTreePVToCSI(logger, pv)
		if err != nil {
			return nil, fmt.Errorf("failed to translate in tree pv to CSI: %w", err)
		}
		pv, migrated = translated, true
	}
	if pv.Spec.CSI == nil {
		return nil, errNotCSI
	}
	return &volume{spec: &pv.Spec, source: pv.Spec.CSI, migrated: migrated}, nil
}

// volumeCapability is the capability ControllerPublishVolume gets for a PV spec: block or
// mount (fsType, else defaultFSType; mount options), and the access mode.
func volumeCapability(spec *corev1.PersistentVolumeSpec, singleNodeMultiWriter bool, defaultFSType string) (*csi.VolumeCapability, error) {
	if spec.CSI == nil {
		return nil, errors.New("CSI volume source was nil")
	}
	mode, err := accessmodes.ToCSIAccessMode(spec.AccessModes, singleNodeMultiWriter)
	if err != nil {
		return nil, err
	}
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if spec.VolumeMode != nil && *spec.VolumeMode == corev1.PersistentVolumeBlock {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		return c, nil
	}
	fsType := spec.CSI.FSType
	if fsType == "" {
		fsType = defaultFSType
	}
	c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{
		FsType:     fsType,
		MountFlags: spec.MountOptions,
	}}
	return c, nil
}

// nodeIDFromCSINode is the node ID the driver registered in a CSINode.
func nodeIDFromCSINode(driver string, n *storagev1.CSINode) (string, bool) {
	for _, d := range n.Spec.Drivers {
		if d.Name == driver {
			return d.NodeID, true
		}
	}
	return "", false
}

// nodeIDFromNode is the node ID in a Node's csi.volume.kubernetes.io/nodeid annotation,
// which kubelets wrote before CSINode existed.
func nodeIDFromNode(driver string, n *corev1.Node) (string, bool) {
	raw, ok := n.Annotations[nodeIDsAnnotation]
	if !ok {
		return "", false
	}
	ids := map[string]string{}
	if err := json.Unmarshal([]byte(raw), &ids); err != nil {
		return "", false
	}
	id, ok := ids[driver]
	return id, ok && id != ""
}

// shouldEnqueueVAChange filters out updates that only changed attachError or detachError:
// those are this controller's own writes, and processing them again would call the driver
// again at once, defeating the exponential backoff.
func shouldEnqueueVAChange(old, updated *storagev1.VolumeAttachment) bool {
	if old.ResourceVersion == updated.ResourceVersion {
		return true // periodic resync
	}
	if old.Status.AttachError == nil && old.Status.DetachError == nil &&
		updated.Status.AttachError == nil && updated.Status.DetachError == nil {
		return true
	}
	sanitized := updated.DeepCopy()
	sanitized.ResourceVersion = old.ResourceVersion
	sanitized.ManagedFields = old.ManagedFields
	sanitized.Status.AttachError = old.Status.AttachError
	sanitized.Status.DetachError = old.Status.DetachError
	return !equality.Semantic.DeepEqual(old, sanitized)
}

// volumeError is how a failure is recorded in a VolumeAttachment's status. withCode adds
// the gRPC code of a driver error (MutableCSINodeAllocatableCount).
func volumeError(err error, withCode bool, now metav1.Time) *storagev1.VolumeError {
	ve := &storagev1.VolumeError{Message: err.Error(), Time: now}
	if withCode {
		if st, ok := status.FromError(err); ok {
			code := int32(st.Code())
			ve.ErrorCode = &code
		}
	}
	return ve
}

// hasFinalizer tells whether obj's finalizers include name.
func hasFinalizer(finalizers []string, name string) bool { return slices.Contains(finalizers, name) }

// withoutFinalizer returns finalizers without name (nil when none is left).
func withoutFinalizer(finalizers []string, name string) []string {
	var out []string
	for _, f := range finalizers {
		if f != name {
			out = append(out, f)
		}
	}
	return out
}

// publishedTo tells whether ListVolumes reported a volume as published to nodeID.
func publishedTo(published map[string][]string, handle, nodeID string) bool {
	return slices.Contains(published[handle], nodeID)
}
