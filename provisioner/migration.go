package provisioner

import (
	"fmt"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	csitrans "k8s.io/csi-translation-lib"
	"k8s.io/klog/v2"
)

// CSI migration. A driver that replaces an in-tree volume plugin (csi-translation-lib's
// mapping: ebs.csi.aws.com replaces kubernetes.io/aws-ebs, and so on) provisions the claims
// of StorageClasses that still name the in-tree plugin once kube-controller-manager hands
// them over, and deletes the in-tree PersistentVolumes it made, as upstream does:
//
//   - A claim is handed over when its storage-provisioner annotation names the driver
//     (kube-controller-manager writes the driver's name there for a migrated plugin), or
//     names the in-tree plugin while pv.kubernetes.io/migrated-to names the driver.
//   - Its class is translated (parameters, allowedTopologies) before anything is read from
//     it; CreateVolume gets the translated class's parameters.
//   - The PersistentVolume is written in the in-tree form (for EBS an awsElasticBlockStore
//     source) with pv.kubernetes.io/provisioned-by naming the in-tree plugin, so that
//     nothing changes for the rest of the cluster; kube-controller-manager adds
//     pv.kubernetes.io/migrated-to itself.
//   - Such a PersistentVolume is the driver's when it was provisioned by either name or is
//     migrated to the driver, and, unlike upstream, its in-tree source is of the plugin the
//     driver replaces: a volume of another plugin must never be sent to this driver.
//     DeleteVolume gets the translated volume handle.
//   - The CSI calls of migrated volumes are counted with migrated="true", as upstream.

// driverNames are the names a claim, class or PersistentVolume may give the driver.
type driverNames struct {
	driver string
	// inTree is the in-tree plugin the driver replaces, "" for none.
	inTree string
}

// namesOf returns the driver's names: csi-translation-lib says which in-tree plugin, if
// any, it replaces.
func namesOf(driver string) driverNames {
	tr := csitrans.New()
	if !tr.IsMigratedCSIDriverByName(driver) {
		return driverNames{driver: driver}
	}
	inTree, err := tr.GetInTreeNameFromCSIName(driver)
	if err != nil {
		// IsMigratedCSIDriverByName said there is one: not reached.
		return driverNames{driver: driver}
	}
	return driverNames{driver: driver, inTree: inTree}
}

// isInTree tells whether name is the in-tree plugin the driver replaces.
func (n driverNames) isInTree(name string) bool { return n.inTree != "" && name == n.inTree }

// claimNamesDriver tells whether a claim asks the driver for its volume: its provisioner
// annotation names the driver, or names the in-tree plugin the driver replaces while the
// migrated-to annotation names the driver (upstream's ShouldProvision with the library's
// known provisioners).
func (n driverNames) claimNamesDriver(claim *v1.PersistentVolumeClaim) bool {
	p := claimProvisioner(claim)
	return p == n.driver || (n.isInTree(p) && claim.Annotations[volumehelpers.AnnMigratedTo] == n.driver)
}

// classOfDriver tells whether the driver provisions the class's volumes: it names the
// driver or the in-tree plugin the driver replaces.
func (n driverNames) classOfDriver(class *storagev1.StorageClass) bool {
	return class.Provisioner == n.driver || n.isInTree(class.Provisioner)
}

// csiClass is the class as CSI sees it: the class itself, or for a class of the in-tree
// plugin its translation (migrated true). The class from the cache is never changed.
func (n driverNames) csiClass(class *storagev1.StorageClass) (*storagev1.StorageClass, bool, error) {
	if class == nil || !n.isInTree(class.Provisioner) {
		return class, false, nil
	}
	translated, err := csitrans.New().TranslateInTreeStorageClassToCSI(klog.Background(), n.inTree, class)
	if err != nil {
		return nil, false, fmt.Errorf("failed to translate storage class %s of in-tree plugin %s: %w", class.Name, n.inTree, err)
	}
	return translated, true, nil
}

// inTreeOfDriver tells whether an in-tree PersistentVolume's source is of the plugin the
// driver replaces.
func (n driverNames) inTreeOfDriver(pv *v1.PersistentVolume) bool {
	if n.inTree == "" || pv.Spec.CSI != nil {
		return false
	}
	plugin, err := csitrans.New().GetInTreePluginNameFromSpec(pv, nil)
	return err == nil && plugin == n.inTree
}

// csiVolume is the PersistentVolume as CSI sees it: itself, or for an in-tree volume its
// translation (migrated true), with the same name, UID, annotations, finalizers and status.
// The object from the cache is never changed.
func csiVolume(pv *v1.PersistentVolume) (*v1.PersistentVolume, bool, error) {
	if pv.Spec.CSI != nil {
		return pv, false, nil
	}
	translated, err := csitrans.New().TranslateInTreePVToCSI(klog.Background(), pv)
	if err != nil {
		return nil, false, fmt.Errorf("translating in-tree PersistentVolume %s to CSI: %w", pv.Name, err)
	}
	if translated.Spec.CSI == nil {
		return nil, false, fmt.Errorf("in-tree PersistentVolume %s translated to no CSI source", pv.Name)
	}
	return translated, true, nil
}

// inTreePV is the PersistentVolume of a migrated volume in the in-tree form upstream
// writes.
func inTreePV(pv *v1.PersistentVolume) (*v1.PersistentVolume, error) {
	translated, err := csitrans.New().TranslateCSIPVToInTree(pv)
	if err != nil {
		return nil, fmt.Errorf("failed to translate CSI PV to in-tree: %w", err)
	}
	return translated, nil
}

// claimProvisioner is the provisioner a claim asks for (the GA annotation, else the beta
// one the PV controller still sets).
func claimProvisioner(claim *v1.PersistentVolumeClaim) string {
	if p, ok := claim.Annotations[volumehelpers.AnnStorageProvisioner]; ok {
		return p
	}
	return claim.Annotations[volumehelpers.AnnBetaStorageProvisioner]
}
