package provisioner

import (
	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
)

// The objects the tests start from (internal/testkit/objects), of the driver drv.

const (
	drv     = "drv.example.com"
	zoneKey = "example.com/zone"
	testUID = objects.UID
)

func claimWith(size string, modes ...v1.PersistentVolumeAccessMode) *v1.PersistentVolumeClaim {
	return objects.ClaimWith(size, modes...)
}

func claimFor(name, uid, className string) *v1.PersistentVolumeClaim {
	return objects.ClaimFor(drv, name, uid, className)
}

func class(name string, change func(*storagev1.StorageClass)) *storagev1.StorageClass {
	return objects.Class(drv, name, change)
}

func node(name string, labels map[string]string) *v1.Node { return objects.Node(name, labels) }

func csiNode(name string, keys ...string) *storagev1.CSINode {
	return objects.CSINode(drv, name, keys...)
}

func topo(pairs ...string) *csi.Topology { return objects.Topology(pairs...) }

func boundSource() (*v1.PersistentVolumeClaim, *v1.PersistentVolume) { return objects.BoundSource(drv) }

func readySnapshot() (*snapshotv1.VolumeSnapshot, *snapshotv1.VolumeSnapshotContent) {
	return objects.ReadySnapshot(drv)
}
