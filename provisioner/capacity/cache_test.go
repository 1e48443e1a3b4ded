package capacity

import (
	"testing"

	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cachetest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The informer of the capacity objects, which the tracker runs itself, drops managedFields
// as the core's shared caches do.
func TestTheCapacityCacheHoldsObjectsWithoutManagedFields(t *testing.T) {
	// A wanted object, so that it stays (segment n1 of a late-binding class).
	obj := cachetest.Managed(&storagev1.CSIStorageCapacity{ObjectMeta: metav1.ObjectMeta{Name: "csisc-old", Namespace: capNS, UID: "old",
		Labels: map[string]string{capacityDriverLabel: drv, capacityManagedByLabel: capacityManagedBy}},
		StorageClassName: "fast", NodeTopology: &metav1.LabelSelector{MatchLabels: map[string]string{testdriver.TopologyKey: "n1"}},
		Capacity: resource.NewQuantity(1, resource.BinarySI)})
	cw := newCapacityWorld(t, testdriver.Config{Topology: true}, nil, append(topologyObjects("n1"), lateClass("fast", nil), obj)...)
	cw.waitFor("the capacity object in its cache", func() bool {
		_, exists, _ := cw.tracker.objects.GetByKey(capNS + "/csisc-old")
		return exists
	})
	if cachedObj, _, _ := cw.tracker.objects.GetByKey(capNS + "/csisc-old"); cachetest.HasManagedFields(t, cachedObj) {
		t.Errorf("cached capacity object %+v, want it without managedFields", cachedObj)
	}
}
