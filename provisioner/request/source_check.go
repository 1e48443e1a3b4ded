// A claim's data source, checked as upstream checks it (pure functions): which kind, and
// the CreateVolume content source it gives.

package request

import (
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
)

// ErrExternalPopulator marks a claim whose data source another controller fills: the
// provisioner leaves it alone, as upstream.
var ErrExternalPopulator = errors.New("data source is not handled by the provisioner, assuming an external populator will provision it")

// Data source kinds, finalizers and annotations, with upstream's names (P9).
const (
	PVCKind          = "PersistentVolumeClaim"
	SnapshotKind     = "VolumeSnapshot"
	SnapshotAPIGroup = "snapshot.storage.k8s.io"

	// CloneProtectionFinalizer keeps a source claim while a clone of it is provisioned.
	CloneProtectionFinalizer = "provisioner.storage.kubernetes.io/cloning-protection"
	// SnapshotProtectionFinalizer keeps a VolumeSnapshot while a volume is restored from it.
	SnapshotProtectionFinalizer = "provisioner.storage.kubernetes.io/volumesnapshot-as-source-protection"
	// annAllowVolumeModeChange on a VolumeSnapshotContent lets volumes restored from it
	// have another volume mode than the snapshotted volume.
	annAllowVolumeModeChange = "snapshot.storage.kubernetes.io/allow-volume-mode-change"
)

// SourceKind is what the provisioner does with a claim's data source.
type SourceKind int

const (
	SourceNone     SourceKind = iota
	SourceClone               // a PersistentVolumeClaim: CreateVolume clones its volume
	SourceSnapshot            // a VolumeSnapshot: CreateVolume restores it
)

// SourceRef names the object a claim's volume is made from.
type SourceRef struct {
	Kind            SourceKind
	Namespace, Name string
}

// Key is the source-protection queue's key of the object.
func (r SourceRef) Key() string {
	prefix := "pvc"
	if r.Kind == SourceSnapshot {
		prefix = "snapshot"
	}
	return prefix + "/" + r.Namespace + "/" + r.Name
}

func (r SourceRef) String() string { return r.Key() }

// ClaimSource reads the claim's data source (dataSourceRef, else dataSource) as upstream
// does: a PersistentVolumeClaim is cloned, a VolumeSnapshot restored; anything else
// (populators) is errExternalPopulator. The source is in the namespace dataSourceRef
// names, else in the claim's: whether the claim may use a source of another namespace
// (CrossNamespaceVolumeDataSource) is not decided here.
func ClaimSource(claim *v1.PersistentVolumeClaim) (SourceRef, error) {
	var group, kind, name, namespace string
	switch {
	case claim.Spec.DataSourceRef != nil:
		ds := claim.Spec.DataSourceRef
		kind, name = ds.Kind, ds.Name
		if ds.APIGroup != nil {
			group = *ds.APIGroup
		}
		if ds.Namespace != nil {
			namespace = *ds.Namespace
		}
	case claim.Spec.DataSource != nil:
		ds := claim.Spec.DataSource
		kind, name = ds.Kind, ds.Name
		if ds.APIGroup != nil {
			group = *ds.APIGroup
		}
	default:
		return SourceRef{}, nil
	}
	ref := SourceRef{Namespace: claim.Namespace, Name: name}
	if namespace != "" {
		ref.Namespace = namespace
	}
	switch {
	case kind == PVCKind && group == "":
		ref.Kind = SourceClone
	case kind == SnapshotKind:
		if group != SnapshotAPIGroup {
			return SourceRef{}, fmt.Errorf("the PVC source does not belong to the right APIGroup. Expected %s, Got %s", SnapshotAPIGroup, group)
		}
		ref.Kind = SourceSnapshot
	default:
		return SourceRef{}, ErrExternalPopulator
	}
	if name == "" {
		return SourceRef{}, fmt.Errorf("the PVC source not found for PVC %s", claim.Name)
	}
	return ref, nil
}

// CheckSourceCapability says why the driver cannot make a volume from this kind of source,
// as upstream words it.
func CheckSourceCapability(controller rpc.ControllerCapabilitySet, kind SourceKind) error {
	switch {
	case kind == SourceClone && !controller[csi.ControllerServiceCapability_RPC_CLONE_VOLUME]:
		return errors.New("CSI driver does not support clone operations: controller CLONE_VOLUME capability is not reported")
	case kind == SourceSnapshot && !controller[csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT]:
		return errors.New("CSI driver does not support snapshot restore: controller CREATE_DELETE_SNAPSHOT capability is not reported")
	}
	return nil
}

// CloneSource checks that the source claim can be cloned into claim and returns the
// content source: both with a class, bound to a volume of the class's
// driver, not smaller than the source's request, same volume mode. The classes may differ
// (upstream dropped that check): the driver decides whether it can clone across its
// classes. sourcePV is nil when the source's PersistentVolume is not found.
func CloneSource(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, source *v1.PersistentVolumeClaim, sourcePV *v1.PersistentVolume) (*csi.VolumeContentSource, error) {
	if source == nil {
		ref, _ := ClaimSource(claim)
		return nil, fmt.Errorf("the PVC DataSource %s/%s does not exist", ref.Namespace, ref.Name)
	}
	switch {
	case source.Status.Phase != v1.ClaimBound:
		return nil, fmt.Errorf("the PVC DataSource %s must have a status of Bound.  Got %v", source.Name, source.Status.Phase)
	case source.DeletionTimestamp != nil:
		return nil, fmt.Errorf("the PVC DataSource %s is currently being deleted", source.Name)
	case source.Spec.StorageClassName == nil:
		return nil, fmt.Errorf("the source PVC (%s) storageclass cannot be empty", source.Name)
	case volumehelpers.GetPersistentVolumeClaimClass(claim) == "":
		return nil, fmt.Errorf("the requested PVC (%s) storageclass cannot be empty", claim.Name)
	}
	if requested, sourceSize := RequestedBytes(claim), RequestedBytes(source); requested < sourceSize {
		return nil, fmt.Errorf("error, new PVC request must be greater than or equal in size to the specified PVC data source, requested %v but source is %v", requested, sourceSize)
	}
	if source.Spec.VolumeName == "" {
		return nil, fmt.Errorf("volume name is empty in source PVC %s", source.Name)
	}
	notBound := fmt.Errorf("claim in dataSource not bound or invalid")
	switch {
	case sourcePV == nil, sourcePV.Spec.CSI == nil, sourcePV.Spec.CSI.Driver != class.Provisioner,
		sourcePV.Spec.ClaimRef == nil, sourcePV.Spec.ClaimRef.UID != source.UID,
		sourcePV.Spec.ClaimRef.Namespace != source.Namespace, sourcePV.Spec.ClaimRef.Name != source.Name,
		sourcePV.Status.Phase != v1.VolumeBound:
		return nil, notBound
	}
	if want, got := volumeMode(claim.Spec.VolumeMode), volumeMode(sourcePV.Spec.VolumeMode); want != got {
		return nil, fmt.Errorf("the source PVC and destination PVCs must have the same volume mode for cloning.  Source is %s, but new PVC requested %s", got, want)
	}
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
		Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: sourcePV.Spec.CSI.VolumeHandle},
	}}, nil
}

// volumeMode is the mode, Filesystem when unset (the API's default).
func volumeMode(m *v1.PersistentVolumeMode) v1.PersistentVolumeMode {
	if m == nil {
		return v1.PersistentVolumeFilesystem
	}
	return *m
}

// SnapshotSource checks that the snapshot can be restored into claim and returns the
// content source: bound to a content of the same driver that points back to it, ready,
// with a snapshot handle, a restore size that fits the request and, with
// preventModeConversion, the same volume mode unless the content allows a change.
func SnapshotSource(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, snap *snapshotv1.VolumeSnapshot, content *snapshotv1.VolumeSnapshotContent, preventModeConversion bool) (*csi.VolumeContentSource, error) {
	name := snap.Name
	notBound := fmt.Errorf("snapshot %s not bound", name)
	if snap.DeletionTimestamp != nil && !slices.Contains(snap.Finalizers, SnapshotProtectionFinalizer) {
		// With the finalizer, a restore started before the deletion: finish it rather than
		// leak what the driver may have created.
		return nil, fmt.Errorf("snapshot %s is being deleted", name)
	}
	if snap.Status == nil || snap.Status.BoundVolumeSnapshotContentName == nil || content == nil {
		return nil, notBound
	}
	ref := content.Spec.VolumeSnapshotRef
	if ref.UID != snap.UID || ref.Namespace != snap.Namespace || ref.Name != snap.Name || content.Spec.Driver != class.Provisioner {
		return nil, notBound
	}
	if snap.Status.ReadyToUse == nil || !*snap.Status.ReadyToUse {
		return nil, fmt.Errorf("snapshot %s is not Ready", name)
	}
	if content.Status == nil || content.Status.SnapshotHandle == nil {
		return nil, fmt.Errorf("snapshot handle %s is not available", name)
	}
	if size := snap.Status.RestoreSize; size != nil && RequestedBytes(claim) < size.Value() {
		return nil, fmt.Errorf("requested volume size %d is less than the size %d for the source snapshot %s", RequestedBytes(claim), size.Value(), name)
	}
	if preventModeConversion && content.Spec.SourceVolumeMode != nil && claim.Spec.VolumeMode != nil && *content.Spec.SourceVolumeMode != *claim.Spec.VolumeMode {
		if err := modeChangeAllowed(claim, content); err != nil {
			return nil, err
		}
	}
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
		Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: *content.Status.SnapshotHandle},
	}}, nil
}

// modeChangeAllowed tells why a claim may not change the volume mode of the snapshotted
// volume: only the content's annotation, set by an administrator, allows it.
func modeChangeAllowed(claim *v1.PersistentVolumeClaim, content *snapshotv1.VolumeSnapshotContent) error {
	prefix := fmt.Sprintf("requested volume %s/%s modifies the mode of the source volume but does not have permission to do so. ", claim.Namespace, claim.Name)
	value, ok := content.Annotations[annAllowVolumeModeChange]
	if !ok {
		return fmt.Errorf("%s%s annotation is not present on snapshotcontent %s", prefix, annAllowVolumeModeChange, content.Name)
	}
	allowed, err := strconv.ParseBool(value)
	if err != nil {
		return fmt.Errorf("%sfailed to convert %s annotation value to boolean with error: %v", prefix, annAllowVolumeModeChange, err)
	}
	if !allowed {
		return fmt.Errorf("%s%s is set to false on snapshotcontent %s", prefix, annAllowVolumeModeChange, content.Name)
	}
	return nil
}
