package lifecycle

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// storeInformer is an informer reduced to its store: OwnWrites reads nothing else.
type storeInformer struct {
	cache.SharedInformer
	store cache.Store
}

func (s storeInformer) GetStore() cache.Store { return s.store }

func TestOwnWritesReturnsTheNewerOfCacheAndOwnWrite(t *testing.T) {
	store := cache.NewStore(cache.MetaNamespaceKeyFunc)
	w := NewOwnWrites[*v1.PersistentVolume](klog.Background(), storeInformer{store: store})
	pv := func(rv, phase string) *v1.PersistentVolume {
		return &v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv", ResourceVersion: rv}, Status: v1.PersistentVolumeStatus{Phase: v1.PersistentVolumePhase(phase)}}
	}
	get := func() string {
		t.Helper()
		got, ok, err := w.Get("pv")
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return "missing"
		}
		return got.ResourceVersion + " " + string(got.Status.Phase)
	}

	w.Wrote(pv("9", "Bound"))
	if got := get(); got != "missing" {
		t.Errorf("own write of an object the cache lacks: %s, want missing (a write never brings one back)", got)
	}
	if err := store.Add(pv("5", "Pending")); err != nil {
		t.Fatal(err)
	}
	if got := get(); got != "9 Bound" {
		t.Errorf("cache behind the own write: %s, want 9 Bound", got)
	}
	w.Wrote(pv("7", "Released")) // an older write's answer arriving late changes nothing
	if got := get(); got != "9 Bound" {
		t.Errorf("after a late older write: %s, want 9 Bound", got)
	}
	if err := store.Update(pv("11", "Failed")); err != nil {
		t.Fatal(err)
	}
	if got := get(); got != "11 Failed" {
		t.Errorf("cache newer than the own write: %s, want 11 Failed", got)
	}
	// The entry went when the cache caught up: a stale copy put back is what Get returns.
	if err := store.Update(pv("6", "Pending")); err != nil {
		t.Fatal(err)
	}
	if got := get(); got != "6 Pending" {
		t.Errorf("entry kept after the cache caught up: %s, want 6 Pending", got)
	}
}
