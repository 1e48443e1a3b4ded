package lifecycle

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// storeInformer is an informer reduced to its store and one event handler, which the test
// calls itself.
type storeInformer struct {
	cache.SharedInformer
	store   cache.Store
	handler cache.ResourceEventHandler
}

func (s *storeInformer) GetStore() cache.Store { return s.store }

func (s *storeInformer) AddEventHandler(h cache.ResourceEventHandler) (cache.ResourceEventHandlerRegistration, error) {
	s.handler = h
	return nil, nil
}

func newOwnWrites(t *testing.T) (*OwnWrites[*v1.PersistentVolume], *storeInformer) {
	t.Helper()
	inf := &storeInformer{store: cache.NewStore(cache.MetaNamespaceKeyFunc)}
	w, err := NewOwnWrites[*v1.PersistentVolume](klog.Background(), inf)
	if err != nil {
		t.Fatal(err)
	}
	return w, inf
}

func pvAt(rv, phase string) *v1.PersistentVolume {
	return &v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv", UID: "uid-1", ResourceVersion: rv}, Status: v1.PersistentVolumeStatus{Phase: v1.PersistentVolumePhase(phase)}}
}

// getPV is what w.Get("pv") says: "<resourceVersion> <phase>" or "missing".
func getPV(t *testing.T, w *OwnWrites[*v1.PersistentVolume]) string {
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

func TestOwnWritesReturnsTheNewerOfCacheAndOwnWrite(t *testing.T) {
	w, inf := newOwnWrites(t)
	store, pv, get := inf.store, pvAt, func() string { return getPV(t, w) }

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

// A finalizer removal that lets the API server delete the object answers with the last
// stored copy at the resourceVersion the informer already shows: the object is missing
// from then on, until the informer shows the deletion; a new object of the name is not.
func TestOwnWritesDeletedIsMissingUntilTheInformerCatchesUp(t *testing.T) {
	w, inf := newOwnWrites(t)
	if err := inf.store.Add(pvAt("5", "Released")); err != nil {
		t.Fatal(err)
	}
	gone := pvAt("5", "Released") // the answer to the last finalizer's removal
	gone.DeletionTimestamp = &metav1.Time{}
	w.Wrote(gone)
	if got := getPV(t, w); got != "missing" {
		t.Errorf("after our write deleted it: %s, want missing", got)
	}
	if err := inf.store.Delete(pvAt("5", "Released")); err != nil {
		t.Fatal(err)
	}
	inf.handler.OnDelete(pvAt("5", "Released"))
	recreated := pvAt("8", "Available")
	recreated.UID = "uid-2"
	if err := inf.store.Add(recreated); err != nil {
		t.Fatal(err)
	}
	if got := getPV(t, w); got != "8 Available" {
		t.Errorf("a new object of the name: %s, want 8 Available", got)
	}
	if len(w.deleted) != 0 {
		t.Errorf("record kept after the informer showed the deletion: %v", w.deleted)
	}
}

// A kind the sidecar creates: what it created counts before the informer shows it, in Get
// and in ByIndex, and the informer's copy takes over once it has one.
func TestOwnCreationsShowWhatTheSidecarCreatedBeforeTheInformerDoes(t *testing.T) {
	byPhase := func(obj any) ([]string, error) { return []string{string(obj.(*v1.PersistentVolume).Status.Phase)}, nil }
	inf := cache.NewSharedIndexInformer(&cache.ListWatch{}, &v1.PersistentVolume{}, 0, cache.Indexers{"phase": byPhase})
	w, err := NewOwnCreations[*v1.PersistentVolume](klog.Background(), inf)
	if err != nil {
		t.Fatal(err)
	}
	byIndex := func() []string {
		objs, err := w.ByIndex("phase", "Available")
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, o := range objs {
			out = append(out, o.Name+"@"+o.ResourceVersion)
		}
		return out
	}
	if got := getPV(t, w); got != "missing" {
		t.Fatalf("nothing created: %s", got)
	}
	w.Wrote(pvAt("5", "Available"))
	if got, idx := getPV(t, w), byIndex(); got != "5 Available" || len(idx) != 1 || idx[0] != "pv@5" {
		t.Errorf("created, informer behind: Get %s, ByIndex %v; want the created copy in both", got, idx)
	}
	if err := inf.GetIndexer().Add(pvAt("7", "Available")); err != nil {
		t.Fatal(err)
	}
	if got, idx := getPV(t, w), byIndex(); got != "7 Available" || len(idx) != 1 || idx[0] != "pv@7" {
		t.Errorf("informer caught up: Get %s, ByIndex %v; want the informer's copy, once", got, idx)
	}
}
