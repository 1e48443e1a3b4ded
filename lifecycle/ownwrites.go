package lifecycle

import (
	"fmt"
	"slices"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilcache "k8s.io/apimachinery/pkg/util/cache"
	"k8s.io/apimachinery/pkg/util/resourceversion"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// OwnWrites reads an informer's cache through a sidecar's own writes: Get returns the
// newer, by resourceVersion, of the informer's copy of an object and the copy that the last
// write of this sidecar returned (Wrote). A sync that follows its own write before the
// write's watch event arrived therefore starts from what it wrote, not from the copy the
// write replaced, which would call the driver again or only earn a conflict. This is the
// one way the sidecars deal with a cache older than their own writes.
//
// It is client-go's mutation cache. The informer's store itself is never written: it is
// shared with every sidecar of the process, a newer watch event may already be in it, and
// the event handlers must see the write's own event as the update it is. An object missing
// from the informer is missing (a write never brings back one the informer saw deleted);
// an entry goes as soon as the informer shows its version or a newer one.
//
// Echo tells an informer event of the sidecar's own write from a change by someone else,
// Gone records an object that a write found deleted, and Took a step of the sidecar's work
// on an object that the object itself does not show (a driver call whose result is not
// written yet).
type OwnWrites[T runtime.Object] struct {
	cache cache.MutationCache
	// indexer is the informer's, for ByIndex and creations (NewOwnCreations); nil otherwise.
	indexer cache.Indexer

	mu sync.Mutex
	// deleted maps the key of an object a write of ours deleted to its UID, until the
	// informer shows the deletion.
	deleted map[string]types.UID
	// created holds the objects this sidecar created that the informer does not show yet
	// (NewOwnCreations only), with when. (client-go's mutation cache can hold additions,
	// but its first read of one drops it: it compares the addition with itself.)
	created map[string]created[T]
	// seenDeleted maps the key of an object the informer showed deleted to its UID, for
	// ownWritesTTL (NewOwnCreations only): the answer of a creation that comes after the
	// informer showed the object added and deleted again is not recorded as created.
	seenDeleted *utilcache.LRUExpireCache
	// versions maps the key of every object this sidecar wrote to the UID and
	// resourceVersion its last write returned (Echo), for ownWritesTTL, least recently
	// used first out. Unlike the mutation cache's entries it outlives the informer's
	// catching up: the event of the write comes after that.
	versions *utilcache.LRUExpireCache
	// steps holds the steps this sidecar took on each object (Took), until the informer
	// shows the object deleted.
	steps map[step]struct{}
}

// step is one step of a sidecar's work on one object: another object of the same name is
// other work.
type step struct {
	key  string
	uid  types.UID
	name string
}

// version is an object's UID and resourceVersion as the last write of it returned.
type version struct {
	uid             types.UID
	resourceVersion string
}

type created[T runtime.Object] struct {
	obj T
	at  time.Time
}

// Bounds of the entries. One matters only until the informer shows the write (normally
// milliseconds); the size is far above the writes in flight at once (the workers of a
// sidecar, a few writes each), and the TTL far above any watch delay that is not a lost
// connection (after which the informer relists anyway).
const (
	ownWritesMax = 1024
	ownWritesTTL = 5 * time.Minute
)

// NewOwnWrites reads informer's store through the writes given to Wrote. handlers get the
// informer's events once OwnWrites has taken each into account: a read that an event
// leads to sees OwnWrites as the event left it, which handlers registered on the informer
// itself, run in their own order, are not promised.
func NewOwnWrites[T runtime.Object](logger klog.Logger, informer cache.SharedInformer, handlers ...cache.ResourceEventHandler) (*OwnWrites[T], error) {
	return ownWritesOver[T](logger, informer, nil, handlers)
}

// NewOwnCreations is OwnWrites for a kind the sidecar creates: Get and ByIndex also return
// an object this sidecar created (Wrote) that the informer does not show yet, and its
// updates of it. Such an entry stays until the informer shows the object, a write of this
// sidecar finds it gone (Gone), or ownWritesTTL passes; an object deleted by someone else
// before the informer showed it (a relist in between) is returned until then, which a kind
// can live with when every write of it reports a NotFound to Gone (the capacity objects)
// or when nobody else deletes it (records kept as Events).
//
// handlers get the informer's events as NewOwnWrites says. A handler that starts a read of
// creations on an event needs that: registered on the informer itself, it may see a
// creation added and deleted again before OwnWrites saw it added, and a read it starts
// then would still return the creation.
func NewOwnCreations[T runtime.Object](logger klog.Logger, informer cache.SharedIndexInformer, handlers ...cache.ResourceEventHandler) (*OwnWrites[T], error) {
	return ownWritesOver[T](logger, informer, informer.GetIndexer(), handlers)
}

func ownWritesOver[T runtime.Object](logger klog.Logger, informer cache.SharedInformer, indexer cache.Indexer, handlers []cache.ResourceEventHandler) (*OwnWrites[T], error) {
	opts := cache.MutationCacheOptions{TTL: ownWritesTTL, MaxCacheSize: ownWritesMax, Indexer: indexer}
	w := &OwnWrites[T]{
		cache:    cache.NewIntegerResourceVersionMutationCacheWithOptions(logger, informer.GetStore(), opts),
		indexer:  indexer,
		deleted:  map[string]types.UID{},
		created:  map[string]created[T]{},
		steps:    map[step]struct{}{},
		versions: utilcache.NewLRUExpireCache(ownWritesMax),
	}
	if indexer != nil {
		w.seenDeleted = utilcache.NewLRUExpireCache(ownWritesMax)
	}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
		AddFunc: func(obj any, initial bool) {
			w.seen(obj)
			for _, h := range handlers {
				h.OnAdd(obj, initial)
			}
		},
		UpdateFunc: func(old, obj any) {
			w.seen(obj)
			for _, h := range handlers {
				h.OnUpdate(old, obj)
			}
		},
		DeleteFunc: func(obj any) {
			w.sawDeleted(obj)
			for _, h := range handlers {
				h.OnDelete(obj)
			}
		},
	}); err != nil {
		return nil, fmt.Errorf("watching the informer: %w", err)
	}
	return w, nil
}

// Get is the object of key (namespace/name, or name) as the informer or the last write of
// it knows it, whichever is newer; false when the informer has no such object.
func (w *OwnWrites[T]) Get(key string) (T, bool, error) {
	var zero T
	// A creation is looked up before the informer: one the informer shows in between is
	// then found in the informer, never missed in both.
	c, isCreation := w.createdOnly(key)
	obj, ok, err := w.cache.GetByKey(key)
	if err != nil {
		return zero, false, err
	}
	if !ok {
		if isCreation && w.stillCreated(key, c) {
			return c, true, nil
		}
		return zero, false, nil
	}
	t, ok := obj.(T)
	if !ok {
		return zero, false, nil
	}
	w.mu.Lock()
	gone := w.deletedLocked(t)
	w.mu.Unlock()
	if gone || !w.stillShown(key, t) {
		return zero, false, nil
	}
	return t, true, nil
}

// stillShown tells, after the memory of what this sidecar did to obj was read, whether
// the informer still holds obj. The informer removes an object from its store before its
// handlers learn of the deletion (and drop that memory), so an object still held was held
// when the memory was read: the memory had not been dropped for it. One removed meanwhile
// (or replaced by another of the name) may have met a memory dropped just before the read,
// and is reported missing: a sync that reads it missing does nothing, and the informer's
// event of what replaced it queues another.
func (w *OwnWrites[T]) stillShown(key string, obj T) bool {
	if _, isCreation := w.createdOnly(key); isCreation {
		return true // Get has decided between the creation and the informer's copy
	}
	m, err := meta.Accessor(obj)
	if err != nil {
		return true
	}
	again, ok, err := w.cache.GetByKey(key)
	if err != nil || !ok {
		return false
	}
	am, err := meta.Accessor(again)
	return err == nil && am.GetUID() == m.GetUID()
}

// Took records that this sidecar took a step of its work on obj that obj does not show,
// for example a driver call that succeeded while the write recording it is still to be
// made. GetTaken reports the step until the informer shows obj deleted, so that no later
// sync of obj takes it again. The memory is this process's only: a new leader takes the
// step once more, so such a step must be one that may be repeated (as CSI calls may).
func (w *OwnWrites[T]) Took(obj T, name string) {
	m, err := meta.Accessor(obj)
	if err != nil {
		return
	}
	key, err := cache.MetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.steps[step{key: key, uid: m.GetUID(), name: name}] = struct{}{}
}

// GetTaken is Get, and whether this sidecar took the step of that name (Took) on the
// object returned.
func (w *OwnWrites[T]) GetTaken(key, name string) (obj T, exists, taken bool, err error) {
	var zero T
	obj, exists, err = w.Get(key)
	if !exists || err != nil {
		return obj, exists, false, err
	}
	m, err := meta.Accessor(obj)
	if err != nil {
		return obj, true, false, nil
	}
	w.mu.Lock()
	_, taken = w.steps[step{key: key, uid: m.GetUID(), name: name}]
	w.mu.Unlock()
	if !taken && !w.stillShown(key, obj) {
		// The memory may have been dropped just before it was read: the object is gone.
		return zero, false, false, nil
	}
	return obj, true, taken, nil
}

// deletedLocked tells whether obj, as the informer shows it, is one a write of this
// sidecar deleted or found gone. w.mu is held.
func (w *OwnWrites[T]) deletedLocked(obj T) bool {
	m, err := meta.Accessor(obj)
	if err != nil || len(w.deleted) == 0 {
		return false
	}
	key, err := cache.MetaNamespaceKeyFunc(obj)
	if err != nil {
		return false
	}
	uid, gone := w.deleted[key]
	return gone && uid == m.GetUID()
}

// ByIndex is the objects of an index key of the informer (NewOwnCreations only: it needs
// the informer's indexer), each the newer of the informer's copy and this sidecar's write.
func (w *OwnWrites[T]) ByIndex(index, key string) ([]T, error) {
	if w.indexer == nil {
		return nil, fmt.Errorf("no index %q: not made by NewOwnCreations", index)
	}
	// The creations are read before the informer, as in Get: a creation the informer shows
	// in between is in the informer's answer, and one it does not show yet is in this copy.
	creations := w.creations()
	objs, err := w.cache.ByIndex(index, key)
	if err != nil {
		return nil, err
	}
	fn := w.indexer.GetIndexers()[index]
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]T, 0, len(objs))
	listed := make(map[string]bool, len(objs))
	for _, obj := range objs {
		if k, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
			listed[k] = true
		}
		if t, ok := obj.(T); ok && !w.deletedLocked(t) {
			out = append(out, t)
		}
	}
	for k, c := range creations {
		if listed[k] || !w.stillCreatedLocked(k, c) {
			continue
		}
		current := c
		// Shown since the index was read: the informer's copy (or this sidecar's newer
		// write of it) is the one returned, and its index keys are the ones that count.
		if shown, inInformer, _ := w.cache.GetByKey(k); inInformer {
			t, ok := shown.(T)
			if !ok || w.deletedLocked(t) {
				continue
			}
			current = t
		}
		if keys, err := fn(current); err == nil && slices.Contains(keys, key) {
			out = append(out, current)
		}
	}
	return out, nil
}

// createdOnly is the object of key this sidecar created and the informer had not shown
// when it was last seen (the informer may show it by now).
func (w *OwnWrites[T]) createdOnly(key string) (T, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c, ok := w.created[key]
	if ok && time.Since(c.at) > ownWritesTTL {
		delete(w.created, key)
		ok = false
	}
	return c.obj, ok
}

// creations is a copy of the objects this sidecar created that the informer had not
// shown, by key, without those past ownWritesTTL.
func (w *OwnWrites[T]) creations() map[string]T {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make(map[string]T, len(w.created))
	for k, c := range w.created {
		if time.Since(c.at) > ownWritesTTL {
			delete(w.created, k)
			continue
		}
		out[k] = c.obj
	}
	return out
}

// stillCreated tells whether a creation read by createdOnly or creations, which the
// informer did not show when read after it, still exists as far as this sidecar knows: no
// write of it found it gone, and the informer has not shown it deleted since.
func (w *OwnWrites[T]) stillCreated(key string, obj T) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stillCreatedLocked(key, obj)
}

func (w *OwnWrites[T]) stillCreatedLocked(key string, obj T) bool {
	m, err := meta.Accessor(obj)
	if err != nil {
		return false
	}
	if uid, gone := w.deleted[key]; gone && uid == m.GetUID() {
		return false
	}
	if w.seenDeleted == nil {
		return true
	}
	uid, shownDeleted := w.seenDeleted.Get(key)
	return !shownDeleted || uid != m.GetUID()
}

// seen drops the copy of an object this sidecar created once the informer shows it.
func (w *OwnWrites[T]) seen(obj any) {
	if w.indexer == nil {
		return
	}
	if key, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
		w.mu.Lock()
		delete(w.created, key)
		w.mu.Unlock()
	}
}

// Wrote records obj, as the API server returned it from a write of this sidecar. An answer
// that is being deleted and has no finalizer left means the write (the last finalizer's
// removal) let the API server delete the object; it is the last stored copy, at a
// resourceVersion the informer may still show, so no resourceVersion can say the object
// is gone: Get reports it missing until the informer shows the deletion (or holds another
// object of that name). (The kinds the sidecars write have no graceful deletion, which
// keeps an object without finalizers for a while.)
func (w *OwnWrites[T]) Wrote(obj T) {
	m, err := meta.Accessor(obj)
	if err != nil {
		w.cache.Mutation(obj) // no key either: what the mutation cache makes of it
		return
	}
	key, err := cache.MetaNamespaceKeyFunc(obj)
	if err != nil {
		w.cache.Mutation(obj)
		return
	}
	w.versions.Add(key, version{uid: m.GetUID(), resourceVersion: m.GetResourceVersion()}, ownWritesTTL)
	if m.GetDeletionTimestamp() != nil && len(m.GetFinalizers()) == 0 {
		w.deletedBy(obj, m.GetUID())
		return
	}
	if w.indexer != nil {
		if _, inInformer, _ := w.indexer.GetByKey(key); !inInformer {
			w.mu.Lock()
			defer w.mu.Unlock()
			if uid, gone := w.seenDeleted.Get(key); gone && uid == m.GetUID() {
				return // the informer showed it added and deleted again before this answer
			}
			if len(w.created) >= ownWritesMax {
				clear(w.created) // bounded as the mutation cache is
			}
			w.created[key] = created[T]{obj: obj, at: time.Now()}
			return
		}
	}
	w.cache.Mutation(obj)
}

// Gone records that obj no longer exists, as a write of this sidecar found: its deletion
// succeeded, or a write of it was answered NotFound. Get and ByIndex report the object
// missing from then on, until the informer shows the deletion (or holds another object of
// that name); an object this sidecar created that the informer never showed is forgotten.
// Without it a creation deleted before the informer showed it would be returned for
// ownWritesTTL.
func (w *OwnWrites[T]) Gone(obj T) {
	m, err := meta.Accessor(obj)
	if err != nil {
		return
	}
	w.deletedBy(obj, m.GetUID())
}

// Echo tells whether obj, an object as an informer event brings it, is the echo of this
// sidecar's own write: the version that its last write of the object returned (Wrote), or
// an older one still on its way. It is false for a newer version, which someone else
// wrote, for another object of the name, for versions that do not compare as the API
// server's numbers, and for an object this sidecar has not written within ownWritesTTL.
// An event handler that acts on others' changes but not on the events of its own writes
// asks this. Unlike Get, it does not depend on whether the informer has shown the write
// yet, so it answers alike in every handler of the event and at any time after it. An
// event that comes before the write's answer reached Wrote is not known as its echo yet:
// a handler that may see one (its own worker writes while events arrive) asks again once
// the write is recorded.
func (w *OwnWrites[T]) Echo(obj T) bool {
	m, err := meta.Accessor(obj)
	if err != nil {
		return false
	}
	key, err := cache.MetaNamespaceKeyFunc(obj)
	if err != nil {
		return false
	}
	v, ok := w.versions.Get(key)
	if !ok {
		return false
	}
	last := v.(version)
	if last.uid != m.GetUID() {
		return false
	}
	if m.GetResourceVersion() == last.resourceVersion {
		return true
	}
	cmp, err := resourceversion.CompareResourceVersion(m.GetResourceVersion(), last.resourceVersion)
	return err == nil && cmp < 0
}

func (w *OwnWrites[T]) deletedBy(obj T, uid types.UID) {
	key, err := cache.MetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.deleted) >= ownWritesMax {
		clear(w.deleted) // bounded as the mutation cache is; the informer catches up anyway
	}
	w.deleted[key] = uid
	delete(w.created, key)
}

// sawDeleted drops the records of an object the informer saw deleted, and for creations
// remembers the deletion (seenDeleted).
func (w *OwnWrites[T]) sawDeleted(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	w.versions.Remove(key)
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.deleted, key)
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	m, err := meta.Accessor(obj)
	if err != nil {
		return
	}
	for s := range w.steps {
		if s.key == key && s.uid == m.GetUID() {
			delete(w.steps, s)
		}
	}
	if w.seenDeleted == nil {
		return
	}
	w.seenDeleted.Add(key, m.GetUID(), ownWritesTTL)
	if c, ok := w.created[key]; ok {
		if cm, err := meta.Accessor(c.obj); err == nil && cm.GetUID() == m.GetUID() {
			delete(w.created, key)
		}
	}
}
