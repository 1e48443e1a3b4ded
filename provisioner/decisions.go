package provisioner

import (
	"errors"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
)

// claimProvisioner is the provisioner a claim asks for (the GA annotation, else the beta
// one the PV controller still sets).
func claimProvisioner(claim *v1.PersistentVolumeClaim) string {
	if p, ok := claim.Annotations[volumehelpers.AnnStorageProvisioner]; ok {
		return p
	}
	return claim.Annotations[volumehelpers.AnnBetaStorageProvisioner]
}

// mayNeedVolume is the cheap test informer handlers use: the claim is unbound and asks
// the driver for its volume.
func mayNeedVolume(claim *v1.PersistentVolumeClaim, names driverNames) bool {
	return claim.Spec.VolumeName == "" && names.claimNamesDriver(claim)
}

// wantsVolume decides whether the driver should provision a volume for the claim now;
// when not, why (for the log).
func wantsVolume(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, names driverNames) (bool, string) {
	switch {
	case claim.Spec.VolumeName != "":
		return false, "claim is bound"
	case !names.claimNamesDriver(claim):
		return false, "claim names another provisioner"
	case claim.DeletionTimestamp != nil:
		return false, "claim is being deleted"
	case class == nil:
		return false, "claim has no StorageClass"
	case !names.classOfDriver(class):
		return false, fmt.Sprintf("StorageClass %s names provisioner %s", class.Name, class.Provisioner)
	case isDelayedBinding(class) && claim.Annotations[volumehelpers.AnnSelectedNode] == "":
		// The scheduler sets the node when a pod uses the claim; the provisioner removes it
		// again to ask for another node.
		return false, "waiting for the scheduler to select a node"
	}
	return true, ""
}

func isDelayedBinding(class *storagev1.StorageClass) bool {
	return class.VolumeBindingMode != nil && *class.VolumeBindingMode == storagev1.VolumeBindingWaitForFirstConsumer
}

// dataSourceKind is the kind of the claim's data source ("" for none), for metrics and the
// data source check.
func dataSourceKind(claim *v1.PersistentVolumeClaim) string {
	if ds := claim.Spec.DataSourceRef; ds != nil {
		return ds.Kind
	}
	if ds := claim.Spec.DataSource; ds != nil {
		return ds.Kind
	}
	return ""
}

// errExternalPopulator marks a claim whose data source another controller fills: the
// provisioner leaves it alone, as upstream.
var errExternalPopulator = errors.New("data source is not handled by the provisioner, assuming an external populator will provision it")

// checkCapabilities says why the driver cannot provision this claim, as upstream words it.
func checkCapabilities(plugin rpc.PluginCapabilitySet, controller rpc.ControllerCapabilitySet, needsModify bool) error {
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

// isDriverVolume tells whether the driver is responsible for the PersistentVolume: it is
// a CSI volume and the driver provisioned it, or, for a volume without that annotation
// (static), it is the volume's CSI driver.
//
// An in-tree volume (CSI migration) is the driver's when its source is of the in-tree
// plugin the driver replaces, and it was provisioned by either name or is migrated to the
// driver (pv.kubernetes.io/migrated-to, which kube-controller-manager sets). Upstream does
// not look at the source; a volume of another plugin could not be translated for this
// driver, and a finalizer put on it would never go.
func isDriverVolume(pv *v1.PersistentVolume, names driverNames) bool {
	if pv.Spec.CSI == nil {
		if !names.inTreeOfDriver(pv) {
			return false
		}
		by := pv.Annotations[volumehelpers.AnnDynamicallyProvisioned]
		return by == names.driver || names.isInTree(by) || pv.Annotations[volumehelpers.AnnMigratedTo] == names.driver
	}
	if by, ok := pv.Annotations[volumehelpers.AnnDynamicallyProvisioned]; ok {
		return by == names.driver
	}
	return pv.Spec.CSI.Driver == names.driver
}

// desiredFinalizers returns the PersistentVolume's finalizers as they should be: the
// provisioner's finalizer on bound volumes with reclaim policy Delete (so the volume is
// deleted before its PersistentVolume goes), none with Retain or Recycle. changed tells
// whether they differ from the current ones. Only the driver's volumes (isDriverVolume)
// get here: each can be deleted, so the finalizer always goes again.
func desiredFinalizers(pv *v1.PersistentVolume) (finalizers []string, changed bool) {
	has := slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer)
	switch pv.Spec.PersistentVolumeReclaimPolicy {
	case v1.PersistentVolumeReclaimDelete:
		if !has && pv.DeletionTimestamp == nil && pv.Status.Phase == v1.VolumeBound {
			return append(slices.Clone(pv.Finalizers), volumehelpers.PVDeletionProtectionFinalizer), true
		}
	case v1.PersistentVolumeReclaimRetain, v1.PersistentVolumeReclaimRecycle:
		if has {
			return withoutFinalizer(pv.Finalizers), true
		}
	}
	return pv.Finalizers, false
}

func withoutFinalizer(finalizers []string) []string {
	return slices.DeleteFunc(slices.Clone(finalizers), func(f string) bool { return f == volumehelpers.PVDeletionProtectionFinalizer })
}

// shouldDelete tells whether the volume behind a PersistentVolume should be deleted now:
// released, reclaim policy Delete, and not already deleted (a PersistentVolume being
// deleted without the provisioner's finalizer was done with).
func shouldDelete(pv *v1.PersistentVolume) bool {
	switch {
	case pv.DeletionTimestamp != nil && !slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer):
		return false
	case pv.Status.Phase != v1.VolumeReleased:
		return false
	}
	return pv.Spec.PersistentVolumeReclaimPolicy == v1.PersistentVolumeReclaimDelete
}
