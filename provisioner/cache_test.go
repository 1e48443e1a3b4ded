package provisioner

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cachetest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The caches the provisioner decides from hold objects trimmed as the core's shared caches
// trim them (the tests' factories too), and provisioning works on them; the informers it
// runs itself (snapshots; capacity objects: package capacity) drop managedFields the same way.
func TestEveryCacheHoldsObjectsWithoutManagedFields(t *testing.T) {
	snap := cachetest.Managed(&snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "snap", Namespace: "ns"}})
	caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)
	w := newWorld(t, testdriver.Config{ControllerCapabilities: caps},
		func(c *config) { c.snapshotClient = noWatchList{snapfake.NewSimpleClientset(snap)} },
		cachetest.Managed(class("fast", nil)), cachetest.Managed(claimFor("data", "uid-1", "fast")))
	w.waitFor("the PersistentVolume", func() bool { return w.pv("pvc-uid-1") != nil })
	w.settle()
	claim, err := w.factory.Core().V1().PersistentVolumeClaims().Lister().PersistentVolumeClaims("ns").Get("data")
	if err != nil || cachetest.HasManagedFields(t, claim) {
		t.Errorf("cached claim %+v (err %v), want it without managedFields", claim, err)
	}
	w.waitFor("the snapshot in its cache", func() bool {
		_, exists, _ := w.ctrl.sources.SnapshotCache().GetByKey("ns/snap")
		return exists
	})
	cached, _, _ := w.ctrl.sources.SnapshotCache().GetByKey("ns/snap")
	if cachetest.HasManagedFields(t, cached) {
		t.Errorf("cached snapshot %+v, want it without managedFields", cached)
	}

}
