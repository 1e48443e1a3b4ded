package lifecycle

import (
	"fmt"
	"slices"
	"sync"
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

// Echo tells the events of the sidecar's own writes from others' changes: the version its
// last write returned and older ones are its own, a newer one or another object of the
// name is not; it keeps answering after the informer has caught up (when Get no longer
// knows the write).
func TestOwnWritesEchoTellsTheEventsOfItsOwnWritesFromOthersChanges(t *testing.T) {
	w, inf := newOwnWrites(t)
	if err := inf.store.Add(pvAt("5", "Pending")); err != nil {
		t.Fatal(err)
	}
	if w.Echo(pvAt("5", "Pending")) {
		t.Errorf("an object never written is an echo")
	}
	w.Wrote(pvAt("9", "Bound"))
	for _, tc := range []struct {
		rv   string
		want bool
	}{{"9", true}, {"7", true}, {"11", false}, {"not-a-number", false}} {
		if got := w.Echo(pvAt(tc.rv, "Bound")); got != tc.want {
			t.Errorf("Echo of version %s after a write at 9: %v, want %v", tc.rv, got, tc.want)
		}
	}
	other := pvAt("9", "Bound")
	other.UID = "uid-2"
	if w.Echo(other) {
		t.Errorf("another object of the name, at the written version, is an echo")
	}
	// The informer shows the write: Get drops its entry, Echo still knows the write.
	if err := inf.store.Update(pvAt("9", "Bound")); err != nil {
		t.Fatal(err)
	}
	if got := getPV(t, w); got != "9 Bound" {
		t.Fatalf("informer caught up: %s", got)
	}
	if !w.Echo(pvAt("9", "Bound")) {
		t.Errorf("the write's event after the informer caught up is not an echo")
	}
	// Deleted: nothing of it is an echo any more.
	inf.handler.OnDelete(pvAt("9", "Bound"))
	if w.Echo(pvAt("9", "Bound")) {
		t.Errorf("an echo after the informer saw the object deleted")
	}
}

// Gone: an object a write found deleted is missing from Get and ByIndex, whether the
// informer shows it or only this sidecar's creation does, until the informer shows the
// deletion; a new object of the name is not.
func TestOwnCreationsGoneIsMissingUntilTheInformerShowsTheDeletion(t *testing.T) {
	byPhase := func(obj any) ([]string, error) { return []string{string(obj.(*v1.PersistentVolume).Status.Phase)}, nil }
	inf := cache.NewSharedIndexInformer(&cache.ListWatch{}, &v1.PersistentVolume{}, 0, cache.Indexers{"phase": byPhase})
	w, err := NewOwnCreations[*v1.PersistentVolume](klog.Background(), inf)
	if err != nil {
		t.Fatal(err)
	}
	byIndex := func() int {
		objs, err := w.ByIndex("phase", "Available")
		if err != nil {
			t.Fatal(err)
		}
		return len(objs)
	}
	// Created, never shown by the informer (a relist in between), then found gone.
	w.Wrote(pvAt("5", "Available"))
	w.Gone(pvAt("5", "Available"))
	if got, n := getPV(t, w), byIndex(); got != "missing" || n != 0 {
		t.Errorf("a creation found gone: Get %s, ByIndex %d objects; want missing, none", got, n)
	}
	// Shown by the informer, then deleted by this sidecar: missing before the informer
	// shows the deletion.
	if err := inf.GetIndexer().Add(pvAt("7", "Available")); err != nil {
		t.Fatal(err)
	}
	w.Gone(pvAt("7", "Available"))
	if got, n := getPV(t, w), byIndex(); got != "missing" || n != 0 {
		t.Errorf("deleted, informer behind: Get %s, ByIndex %d objects; want missing, none", got, n)
	}
	// A new object of the name is not the one gone.
	if err := inf.GetIndexer().Delete(pvAt("7", "Available")); err != nil {
		t.Fatal(err)
	}
	recreated := pvAt("9", "Available")
	recreated.UID = "uid-2"
	if err := inf.GetIndexer().Add(recreated); err != nil {
		t.Fatal(err)
	}
	if got, n := getPV(t, w), byIndex(); got != "9 Available" || n != 1 {
		t.Errorf("a new object of the name: Get %s, ByIndex %d objects; want 9 Available, one", got, n)
	}
}

// indexInformer is an informer that is never started: the test changes its indexer and
// calls the one event handler itself.
type indexInformer struct {
	cache.SharedIndexInformer
	handler cache.ResourceEventHandler
}

func (s *indexInformer) AddEventHandler(h cache.ResourceEventHandler) (cache.ResourceEventHandlerRegistration, error) {
	s.handler = h
	return nil, nil
}

// A creation that someone deletes at once may be shown added and deleted by the informer
// before the creation's answer reaches Wrote, or its deletion may reach OwnWrites after
// Wrote: either way it is missing, also for the handlers given to NewOwnCreations, which
// get each event after OwnWrites took it into account. A new object of the name is not.
func TestOwnCreationsACreationTheInformerShowedDeletedIsMissing(t *testing.T) {
	inf := &indexInformer{SharedIndexInformer: cache.NewSharedIndexInformer(&cache.ListWatch{}, &v1.PersistentVolume{}, 0, cache.Indexers{})}
	var w *OwnWrites[*v1.PersistentVolume]
	var onDelete []string
	w, err := NewOwnCreations[*v1.PersistentVolume](klog.Background(), inf, cache.ResourceEventHandlerFuncs{
		DeleteFunc: func(any) { onDelete = append(onDelete, getPV(t, w)) },
	})
	if err != nil {
		t.Fatal(err)
	}
	shown := func(obj *v1.PersistentVolume) { // added to and deleted from the informer's store
		if err := inf.GetIndexer().Add(obj); err != nil {
			t.Fatal(err)
		}
		if err := inf.GetIndexer().Delete(obj); err != nil {
			t.Fatal(err)
		}
	}

	// Added and deleted before the answer.
	shown(pvAt("5", "Available"))
	inf.handler.OnAdd(pvAt("5", "Available"), false)
	inf.handler.OnDelete(pvAt("5", "Available"))
	w.Wrote(pvAt("5", "Available"))
	if got := getPV(t, w); got != "missing" {
		t.Errorf("answer after the informer showed the deletion: %s, want missing", got)
	}

	// The deletion's event reaches OwnWrites after the answer.
	second := pvAt("7", "Available")
	second.UID = "uid-2"
	shown(second)
	inf.handler.OnAdd(second, false)
	w.Wrote(second)
	if got := getPV(t, w); got != "7 Available" {
		t.Errorf("a new object of the name, created: %s, want 7 Available", got)
	}
	inf.handler.OnDelete(second)
	if got := getPV(t, w); got != "missing" {
		t.Errorf("after the informer's deletion event: %s, want missing", got)
	}
	if want := []string{"missing", "missing"}; !slices.Equal(onDelete, want) {
		t.Errorf("the handler read %v in its deletion events, want %v", onDelete, want)
	}
}

// racingIndexer is an informer's indexer whose next read is overtaken, once, by the
// informer: after answering, it runs then (which shows a new object and calls the event
// handler), as a watch event that arrives during a read of OwnWrites does.
type racingIndexer struct {
	cache.Indexer
	then func()
}

func (r *racingIndexer) overtaken() {
	if f := r.then; f != nil {
		r.then = nil
		f()
	}
}

func (r *racingIndexer) GetByKey(key string) (any, bool, error) {
	defer r.overtaken()
	return r.Indexer.GetByKey(key)
}

func (r *racingIndexer) ByIndex(index, key string) ([]any, error) {
	defer r.overtaken()
	return r.Indexer.ByIndex(index, key)
}

func (r *racingIndexer) IndexKeys(index, key string) ([]string, error) {
	defer r.overtaken()
	return r.Indexer.IndexKeys(index, key)
}

type racingInformer struct {
	indexInformer
	indexer *racingIndexer
}

func (s *racingInformer) GetStore() cache.Store     { return s.indexer }
func (s *racingInformer) GetIndexer() cache.Indexer { return s.indexer }

// A creation that the informer shows while Get or ByIndex reads is found: in the
// informer's answer, or, read before it, among the creations (it is never missing from
// both, which once made the provisioner take a closed record for an open one).
func TestOwnCreationsACreationShownDuringAReadIsFound(t *testing.T) {
	byPhase := func(obj any) ([]string, error) { return []string{string(obj.(*v1.PersistentVolume).Status.Phase)}, nil }
	shared := cache.NewSharedIndexInformer(&cache.ListWatch{}, &v1.PersistentVolume{}, 0, cache.Indexers{"phase": byPhase})
	inf := &racingInformer{indexInformer: indexInformer{SharedIndexInformer: shared}, indexer: &racingIndexer{Indexer: shared.GetIndexer()}}
	w, err := NewOwnCreations[*v1.PersistentVolume](klog.Background(), inf)
	if err != nil {
		t.Fatal(err)
	}
	for _, read := range []struct {
		name string
		get  func() string
	}{
		{"Get", func() string { return getPV(t, w) }},
		{"ByIndex", func() string {
			objs, err := w.ByIndex("phase", "Available")
			if err != nil {
				t.Fatal(err)
			}
			if len(objs) != 1 {
				return fmt.Sprintf("%d objects", len(objs))
			}
			return objs[0].ResourceVersion + " " + string(objs[0].Status.Phase)
		}},
	} {
		pv := pvAt("5", "Available")
		if err := shared.GetIndexer().Delete(pv); err != nil {
			t.Fatal(err)
		}
		w.Wrote(pv)
		inf.indexer.then = func() {
			if err := shared.GetIndexer().Add(pv); err != nil {
				t.Fatal(err)
			}
			inf.handler.OnAdd(pv, false)
		}
		if got := read.get(); got != "5 Available" {
			t.Errorf("%s while the informer shows the creation: %s, want 5 Available", read.name, got)
		}
		if inf.indexer.then != nil {
			t.Errorf("%s did not read the informer", read.name)
		}
	}
}

// onceAfterRead is a store that runs after once, right after its first read of key.
type onceAfterRead struct {
	cache.Store
	key   string
	once  sync.Once
	after func()
}

func (s *onceAfterRead) GetByKey(key string) (any, bool, error) {
	obj, ok, err := s.Store.GetByKey(key)
	if key == s.key {
		s.once.Do(s.after)
	}
	return obj, ok, err
}

// The informer removes a deleted object from its store, then tells its handlers, which
// drop what OwnWrites remembered of the object. A read that got the object from the store
// just before, and looks at the memory just after, must not take the object for one this
// sidecar never touched: the sync would take its steps again (a second DeleteVolume, or the
// writes after it). It reports the object missing.
func TestOwnWritesAReadThatMeetsTheInformersDeletionReportsTheObjectMissing(t *testing.T) {
	for _, tc := range []struct {
		name     string
		remember func(w *OwnWrites[*v1.PersistentVolume], pv *v1.PersistentVolume)
	}{
		{"deleted by a write of ours (Gone)", func(w *OwnWrites[*v1.PersistentVolume], pv *v1.PersistentVolume) { w.Gone(pv) }},
		{"a step taken (Took)", func(w *OwnWrites[*v1.PersistentVolume], pv *v1.PersistentVolume) { w.Took(pv, "DeleteVolume") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := &onceAfterRead{Store: cache.NewStore(cache.MetaNamespaceKeyFunc), key: "pv"}
			inf := &storeInformer{store: store}
			w, err := NewOwnWrites[*v1.PersistentVolume](klog.Background(), inf)
			if err != nil {
				t.Fatal(err)
			}
			pv := pvAt("5", "Released")
			if err := store.Add(pv); err != nil {
				t.Fatal(err)
			}
			tc.remember(w, pv)
			store.after = func() {
				if err := store.Delete(pv); err != nil {
					t.Error(err)
				}
				inf.handler.OnDelete(pv)
			}
			got, exists, taken, err := w.GetTaken("pv", "DeleteVolume")
			if err != nil {
				t.Fatal(err)
			}
			if exists {
				t.Errorf("read while the informer showed the deletion: %s (step taken %v), want missing", got.ResourceVersion, taken)
			}
			if len(w.steps) != 0 || len(w.deleted) != 0 {
				t.Errorf("memory kept after the informer showed the deletion: steps %v, deleted %v", w.steps, w.deleted)
			}
		})
	}
}

// A step taken is reported for that object until the informer shows it deleted, and never
// for another object of the name.
func TestOwnWritesRemembersAStepTakenUntilTheInformerShowsTheDeletion(t *testing.T) {
	w, inf := newOwnWrites(t)
	pv := pvAt("5", "Released")
	if err := inf.store.Add(pv); err != nil {
		t.Fatal(err)
	}
	taken := func() string {
		t.Helper()
		got, exists, taken, err := w.GetTaken("pv", "DeleteVolume")
		if err != nil {
			t.Fatal(err)
		}
		if !exists {
			return "missing"
		}
		return fmt.Sprintf("%s %v", got.UID, taken)
	}
	if got := taken(); got != "uid-1 false" {
		t.Errorf("before the step: %s, want uid-1 false", got)
	}
	w.Took(pv, "DeleteVolume")
	if got := taken(); got != "uid-1 true" {
		t.Errorf("after the step: %s, want uid-1 true", got)
	}
	if _, _, other, _ := w.GetTaken("pv", "another step"); other {
		t.Errorf("another step reported taken")
	}
	if err := inf.store.Delete(pv); err != nil {
		t.Fatal(err)
	}
	inf.handler.OnDelete(pv)
	recreated := pvAt("8", "Available")
	recreated.UID = "uid-2"
	if err := inf.store.Add(recreated); err != nil {
		t.Fatal(err)
	}
	if got := taken(); got != "uid-2 false" {
		t.Errorf("a new object of the name: %s, want uid-2 false", got)
	}
	if len(w.steps) != 0 {
		t.Errorf("steps kept after the informer showed the deletion: %v", w.steps)
	}
}
