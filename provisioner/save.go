// The PersistentVolume built from the driver's answer, and saved.

package provisioner

import (
	"fmt"
	"maps"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	volumehelpers "k8s.io/component-helpers/storage/volume"

	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// savePVBackoff bounds how long one sync retries saving a PersistentVolume before it gives
// the claim back to the queue (which retries CreateVolume, idempotent, and the save).
func savePVBackoff() wait.Backoff {
	return wait.Backoff{Duration: 100 * time.Millisecond, Factor: 2, Steps: 6, Cap: 2 * time.Second}
}

// pvInput is what the PersistentVolume of a new volume is made from.
type pvInput struct {
	name     string
	driver   string
	claim    *v1.PersistentVolumeClaim
	class    *storagev1.StorageClass
	volume   *csi.Volume
	fsType   string
	secrets  request.SecretRefs
	readOnly bool
	// requestedBytes is the capacity asked for; the PersistentVolume gets what the driver
	// reports, or this when the driver reports 0 (unknown).
	requestedBytes int64
	// identity is this provisioner instance, recorded in the volume attributes.
	identity string
	// topology: the driver reports accessibility, so the PersistentVolume gets node
	// affinity.
	topology bool
	// vac is the claim's VolumeAttributesClass name, "" for none.
	vac string
	// fromSource: CreateVolume was asked to clone or restore, so the volume must say it
	// was made from a source.
	fromSource bool
	// migrated: the class names the in-tree plugin the driver replaces (CSI migration),
	// so the PersistentVolume is written in the in-tree form.
	migrated bool
}

// buildPV makes the PersistentVolume that records a created volume, as upstream: bound to
// the claim by claimRef (the PV controller completes the binding), protected by the
// provisioner's finalizer when the reclaim policy is Delete, and carrying everything later
// calls need (secrets, node affinity, file system). For a class of the in-tree plugin the
// driver replaces, it is the in-tree form csi-translation-lib makes of it, provisioned by
// the in-tree plugin, as upstream writes it.
func buildPV(in pvInput) (*v1.PersistentVolume, error) {
	capacity, err := request.PVCapacity(in.volume.GetCapacityBytes(), in.requestedBytes)
	if err != nil {
		return nil, err
	}
	if in.fromSource && in.volume.GetContentSource() == nil {
		// The driver made an empty volume where the user asked for data.
		return nil, fmt.Errorf("volume content source missing")
	}
	attributes := map[string]string{request.ProvisionerIDKey: in.identity}
	maps.Copy(attributes, in.volume.GetVolumeContext())
	source := &v1.CSIPersistentVolumeSource{
		Driver:                     in.driver,
		VolumeHandle:               in.volume.GetVolumeId(),
		VolumeAttributes:           attributes,
		ReadOnly:                   in.readOnly,
		ControllerPublishSecretRef: in.secrets.ControllerPublish,
		NodeStageSecretRef:         in.secrets.NodeStage,
		NodePublishSecretRef:       in.secrets.NodePublish,
		ControllerExpandSecretRef:  in.secrets.ControllerExpand,
		NodeExpandSecretRef:        in.secrets.NodeExpand,
	}
	if !request.IsBlock(in.claim) {
		source.FSType = in.fsType
	}
	// Upstream's library writes the class's provisioner: the driver, or the in-tree plugin.
	provisionedBy := in.driver
	if in.migrated {
		provisionedBy = in.class.Provisioner
	}
	reclaim := v1.PersistentVolumeReclaimDelete
	if in.class.ReclaimPolicy != nil {
		reclaim = *in.class.ReclaimPolicy
	}
	pv := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name: in.name,
			Annotations: map[string]string{
				volumehelpers.AnnDynamicallyProvisioned: provisionedBy,
				request.AnnDeletionSecretName:           "",
				request.AnnDeletionSecretNamespace:      "",
			},
		},
		Spec: v1.PersistentVolumeSpec{
			AccessModes:                   in.claim.Spec.AccessModes,
			MountOptions:                  in.class.MountOptions,
			Capacity:                      v1.ResourceList{v1.ResourceStorage: *resource.NewQuantity(capacity, resource.BinarySI)},
			PersistentVolumeSource:        v1.PersistentVolumeSource{CSI: source},
			PersistentVolumeReclaimPolicy: reclaim,
			StorageClassName:              volumehelpers.GetPersistentVolumeClaimClass(in.claim),
			VolumeMode:                    in.claim.Spec.VolumeMode,
			ClaimRef: &v1.ObjectReference{
				Kind:            "PersistentVolumeClaim",
				APIVersion:      "v1",
				Namespace:       in.claim.Namespace,
				Name:            in.claim.Name,
				UID:             in.claim.UID,
				ResourceVersion: in.claim.ResourceVersion,
			},
		},
	}
	if ref := in.secrets.Provisioner; ref != nil {
		pv.Annotations[request.AnnDeletionSecretName] = ref.Name
		pv.Annotations[request.AnnDeletionSecretNamespace] = ref.Namespace
	}
	if ref := in.secrets.ControllerModify; ref != nil {
		pv.Annotations[request.AnnModifySecretName] = ref.Name
		pv.Annotations[request.AnnModifySecretNamespace] = ref.Namespace
	}
	if reclaim == v1.PersistentVolumeReclaimDelete {
		pv.Finalizers = []string{volumehelpers.PVDeletionProtectionFinalizer}
	}
	if in.topology {
		pv.Spec.NodeAffinity = request.NodeAffinity(in.volume.GetAccessibleTopology())
	}
	if in.vac != "" {
		pv.Spec.VolumeAttributesClassName = &in.vac
	}
	if in.migrated {
		return request.InTreePV(pv)
	}
	return pv, nil
}

// readOnlyPV tells whether the PersistentVolume is marked read-only: with
// --controller-publish-readonly, when the only access mode is ReadOnlyMany.
func readOnlyPV(caps []*csi.VolumeCapability, controllerPublishReadOnly bool) bool {
	return controllerPublishReadOnly && len(caps) == 1 &&
		caps[0].GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
}
