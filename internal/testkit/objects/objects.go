// Package objects makes the API objects that the provisioner's tests start from: claims,
// classes, nodes and data sources of one driver, as an API server would hold them.
package objects

import (
	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"
)

// UID is the UID of the claim ClaimWith makes.
const UID = types.UID("3f2a1b4c-5d6e-4f70-8192-a3b4c5d6e7f8")

// ClaimWith is claim ns/data of UID asking for size ("" for none) with modes.
func ClaimWith(size string, modes ...v1.PersistentVolumeAccessMode) *v1.PersistentVolumeClaim {
	c := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "data", Namespace: "ns", UID: UID},
		Spec:       v1.PersistentVolumeClaimSpec{AccessModes: modes},
	}
	if size != "" {
		c.Spec.Resources.Requests = v1.ResourceList{v1.ResourceStorage: resource.MustParse(size)}
	}
	return c
}

// ClaimFor is a claim of driver in namespace ns, asking for 1Gi ReadWriteOnce of class
// className.
func ClaimFor(driver, name, uid, className string) *v1.PersistentVolumeClaim {
	c := ClaimWith("1Gi", v1.ReadWriteOnce)
	c.Name, c.UID = name, types.UID(uid)
	c.Annotations = map[string]string{volumehelpers.AnnStorageProvisioner: driver}
	c.Spec.StorageClassName = ptr.To(className)
	return c
}

// Class is a StorageClass of driver with parameter type=fast, deleting its volumes, as
// change (nil for none) makes it.
func Class(driver, name string, change func(*storagev1.StorageClass)) *storagev1.StorageClass {
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: driver,
		ReclaimPolicy: ptr.To(v1.PersistentVolumeReclaimDelete), Parameters: map[string]string{"type": "fast"}}
	if change != nil {
		change(sc)
	}
	return sc
}

// Node is a node with labels.
func Node(name string, labels map[string]string) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

// CSINode is the CSINode of node name where driver registered topology keys, beside
// another driver.
func CSINode(driver, name string, keys ...string) *storagev1.CSINode {
	return &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: storagev1.CSINodeSpec{
		Drivers: []storagev1.CSINodeDriver{{Name: "other"}, {Name: driver, NodeID: name, TopologyKeys: keys}},
	}}
}

// Topology is a CSI topology segment of key, value pairs.
func Topology(pairs ...string) *csi.Topology {
	t := &csi.Topology{Segments: map[string]string{}}
	for i := 0; i+1 < len(pairs); i += 2 {
		t.Segments[pairs[i]] = pairs[i+1]
	}
	return t
}

// BoundSource is a source claim ns/src of class fast, bound to PersistentVolume pv-src of
// driver.
func BoundSource(driver string) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
	src := ClaimFor(driver, "src", "uid-src", "fast")
	src.Spec.VolumeName = "pv-src"
	src.Status.Phase = v1.ClaimBound
	pv := &v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-src"}, Spec: v1.PersistentVolumeSpec{
		PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: "vol-src"}},
		ClaimRef:               &v1.ObjectReference{Namespace: "ns", Name: "src", UID: "uid-src"},
	}, Status: v1.PersistentVolumeStatus{Phase: v1.VolumeBound}}
	return src, pv
}

// ReadySnapshot is snapshot ns/snap of 1Gi, bound to content "content" of driver, handle
// "h".
func ReadySnapshot(driver string) (*snapshotv1.VolumeSnapshot, *snapshotv1.VolumeSnapshotContent) {
	snap := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "snap", Namespace: "ns", UID: "uid-snap"},
		Status: &snapshotv1.VolumeSnapshotStatus{BoundVolumeSnapshotContentName: ptr.To("content"), ReadyToUse: ptr.To(true), RestoreSize: ptr.To(resource.MustParse("1Gi"))}}
	content := &snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: "content"},
		Spec: snapshotv1.VolumeSnapshotContentSpec{Driver: driver, VolumeSnapshotRef: v1.ObjectReference{Namespace: "ns", Name: "snap", UID: "uid-snap"},
			SourceVolumeMode: ptr.To(v1.PersistentVolumeFilesystem)},
		Status: &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: ptr.To("h")}}
	return snap, content
}

// CreateVolumeRequest asks for volume name: 1 GiB, mounted ext4, written by one node, with
// the parameters of Class and a secret.
func CreateVolumeRequest(name string) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{
		Name:          name,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30},
		VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}},
		Parameters: map[string]string{"type": "fast"},
		Secrets:    map[string]string{"token": "secret-value"},
	}
}
