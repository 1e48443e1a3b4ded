// Package volume resolves what a VolumeAttachment asks to publish: the CSI source of its
// PersistentVolume (translated by csi-translation-lib when it is an in-tree one) or of its
// inline spec, and the capability ControllerPublishVolume gets for it. It is pure: it reads
// only the objects it is given.
package volume

import (
	"errors"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/accessmodes"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/klog/v2"
)

// MigratedToAnnotation on an in-tree PV names the CSI driver it was migrated to.
const MigratedToAnnotation = "pv.kubernetes.io/migrated-to"

// Translator is the part of csi-translation-lib the attacher uses for in-tree volumes.
type Translator interface {
	IsPVMigratable(pv *corev1.PersistentVolume) bool
	TranslateInTreePVToCSI(logger klog.Logger, pv *corev1.PersistentVolume) (*corev1.PersistentVolume, error)
	RepairVolumeHandle(driver, volumeHandle, nodeID string) (string, error)
}

// Volume is what a VolumeAttachment asks to (un)publish, resolved from its PV (translated
// when it is an in-tree PV) or from its inline spec.
type Volume struct {
	Spec   *corev1.PersistentVolumeSpec
	Source *corev1.CSIPersistentVolumeSource
	// Migrated is set for an in-tree PV translated to CSI and for an inline spec (which
	// only exists for migrated in-tree inline volumes); the reconciler then repairs the
	// volume handle before comparing it with what the driver lists.
	Migrated bool
}

var (
	errBothSources  = errors.New("both InlineCSIVolumeSource and PersistentVolumeName specified in VA source")
	errNoSource     = errors.New("neither InlineCSIVolumeSource nor PersistentVolumeName specified in VA source")
	errInlineNotCSI = errors.New("inline volume spec contains nil CSI source")
	errNotCSI       = errors.New("pv spec contained non-csi source that was not migrated")
)

// Inline resolves an inline spec; ok is false when the VolumeAttachment names a PV.
func Inline(va *storagev1.VolumeAttachment) (v *Volume, ok bool, err error) {
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
	return &Volume{Spec: src.InlineVolumeSpec, Source: src.InlineVolumeSpec.CSI, Migrated: true}, true, nil
}

// FromPV resolves a PV, translating an in-tree one.
func FromPV(logger klog.Logger, tr Translator, pv *corev1.PersistentVolume) (*Volume, error) {
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
	return &Volume{Spec: &pv.Spec, Source: pv.Spec.CSI, Migrated: migrated}, nil
}

// Capability is the capability ControllerPublishVolume gets for a PV spec: block or mount
// (fsType, else defaultFSType; mount options), and the access mode.
func Capability(spec *corev1.PersistentVolumeSpec, singleNodeMultiWriter bool, defaultFSType string) (*csi.VolumeCapability, error) {
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
