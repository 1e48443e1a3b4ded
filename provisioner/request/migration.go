package request

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

// DriverNames are the names a claim, class or PersistentVolume may give the driver.
type DriverNames struct {
	Driver string
	// InTree is the in-tree plugin the driver replaces, "" for none.
	InTree string
}

// NamesOf returns the driver's names: csi-translation-lib says which in-tree plugin, if
// any, it replaces.
func NamesOf(driver string) DriverNames {
	tr := csitrans.New()
	if !tr.IsMigratedCSIDriverByName(driver) {
		return DriverNames{Driver: driver}
	}
	inTree, err := tr.GetInTreeNameFromCSIName(driver)
	if err != nil {
		// IsMigratedCSIDriverByName said there is one: not reached.
		return DriverNames{Driver: driver}
	}
	return DriverNames{Driver: driver, InTree: inTree}
}

// IsInTree tells whether name is the in-tree plugin the driver replaces.
func (n DriverNames) IsInTree(name string) bool { return n.InTree != "" && name == n.InTree }

// ClaimNamesDriver tells whether a claim asks the driver for its volume: its provisioner
// annotation names the driver, or names the in-tree plugin the driver replaces while the
// migrated-to annotation names the driver (upstream's ShouldProvision with the library's
// known provisioners).
func (n DriverNames) ClaimNamesDriver(claim *v1.PersistentVolumeClaim) bool {
	p := ClaimProvisioner(claim)
	return p == n.Driver || (n.IsInTree(p) && claim.Annotations[volumehelpers.AnnMigratedTo] == n.Driver)
}

// ClassOfDriver tells whether the driver provisions the class's volumes: it names the
// driver or the in-tree plugin the driver replaces.
func (n DriverNames) ClassOfDriver(class *storagev1.StorageClass) bool {
	return class.Provisioner == n.Driver || n.IsInTree(class.Provisioner)
}

// CSIClass is the class as CSI sees it: the class itself, or for a class of the in-tree
// plugin its translation (migrated true). The class from the cache is never changed.
func (n DriverNames) CSIClass(class *storagev1.StorageClass) (*storagev1.StorageClass, bool, error) {
	if class == nil || !n.IsInTree(class.Provisioner) {
		return class, false, nil
	}
	translated, err := csitrans.New().TranslateInTreeStorageClassToCSI(klog.Background(), n.InTree, class)
	if err != nil {
		return nil, false, fmt.Errorf("failed to translate storage class %s of in-tree plugin %s: %w", class.Name, n.InTree, err)
	}
	return translated, true, nil
}

// InTreeOfDriver tells whether an in-tree PersistentVolume's source is of the plugin the
// driver replaces.
func (n DriverNames) InTreeOfDriver(pv *v1.PersistentVolume) bool {
	if n.InTree == "" || pv.Spec.CSI != nil {
		return false
	}
	plugin, err := csitrans.New().GetInTreePluginNameFromSpec(pv, nil)
	return err == nil && plugin == n.InTree
}

// CSIVolume is the PersistentVolume as CSI sees it: itself, or for an in-tree volume its
// translation (migrated true), with the same name, UID, annotations, finalizers and status.
// The object from the cache is never changed.
func CSIVolume(pv *v1.PersistentVolume) (*v1.PersistentVolume, bool, error) {
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

// InTreePV is the PersistentVolume of a migrated volume in the in-tree form upstream
// writes.
func InTreePV(pv *v1.PersistentVolume) (*v1.PersistentVolume, error) {
	translated, err := csitrans.New().TranslateCSIPVToInTree(pv)
	if err != nil {
		return nil, fmt.Errorf("failed to translate CSI PV to in-tree: %w", err)
	}
	return translated, nil
}

// ClaimProvisioner is the provisioner a claim asks for (the GA annotation, else the beta
// one the PV controller still sets).
func ClaimProvisioner(claim *v1.PersistentVolumeClaim) string {
	if p, ok := claim.Annotations[volumehelpers.AnnStorageProvisioner]; ok {
		return p
	}
	return claim.Annotations[volumehelpers.AnnBetaStorageProvisioner]
}

// IsDriverVolume tells whether the driver is responsible for the PersistentVolume: it is
// a CSI volume and the driver provisioned it, or, for a volume without that annotation
// (static), it is the volume's CSI driver.
//
// An in-tree volume (CSI migration) is the driver's when its source is of the in-tree
// plugin the driver replaces, and it was provisioned by either name or is migrated to the
// driver (pv.kubernetes.io/migrated-to, which kube-controller-manager sets). Upstream does
// not look at the source; a volume of another plugin could not be translated for this
// driver, and a finalizer put on it would never go.
func IsDriverVolume(pv *v1.PersistentVolume, names DriverNames) bool {
	if pv.Spec.CSI == nil {
		if !names.InTreeOfDriver(pv) {
			return false
		}
		by := pv.Annotations[volumehelpers.AnnDynamicallyProvisioned]
		return by == names.Driver || names.IsInTree(by) || pv.Annotations[volumehelpers.AnnMigratedTo] == names.Driver
	}
	if by, ok := pv.Annotations[volumehelpers.AnnDynamicallyProvisioned]; ok {
		return by == names.Driver
	}
	return pv.Spec.CSI.Driver == names.Driver
}
