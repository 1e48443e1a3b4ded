package lifecycle

import (
	"fmt"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
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
type OwnWrites[T runtime.Object] struct {
	cache cache.MutationCache

	mu sync.Mutex
	// deleted maps the key of an object a write of ours deleted to its UID, until the
	// informer shows the deletion.
	deleted map[string]types.UID
}

// Bounds of the entries. One matters only until the informer shows the write (normally
// milliseconds); the size is far above the writes in flight at once (the workers of a
// sidecar, a few writes each), and the TTL far above any watch delay that is not a lost
// connection (after which the informer relists anyway).
const (
	ownWritesMax = 1024
	ownWritesTTL = 5 * time.Minute
)

// NewOwnWrites reads informer's store through the writes given to Wrote.
func NewOwnWrites[T runtime.Object](logger klog.Logger, informer cache.SharedInformer) (*OwnWrites[T], error) {
	opts := cache.MutationCacheOptions{TTL: ownWritesTTL, MaxCacheSize: ownWritesMax}
	w := &OwnWrites[T]{
		cache:   cache.NewIntegerResourceVersionMutationCacheWithOptions(logger, informer.GetStore(), opts),
		deleted: map[string]types.UID{},
	}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: w.seenDeleted}); err != nil {
		return nil, fmt.Errorf("watching deletions: %w", err)
	}
	return w, nil
}

// Get is the object of key (namespace/name, or name) as the informer or the last write of
// it knows it, whichever is newer; false when the informer has no such object.
func (w *OwnWrites[T]) Get(key string) (T, bool, error) {
	var zero T
	obj, ok, err := w.cache.GetByKey(key)
	if err != nil || !ok {
		return zero, false, err
	}
	t, ok := obj.(T)
	if !ok {
		return zero, false, nil
	}
	if m, err := meta.Accessor(t); err == nil {
		w.mu.Lock()
		uid, gone := w.deleted[key]
		w.mu.Unlock()
		if gone && uid == m.GetUID() {
			return zero, false, nil
		}
	}
	return t, true, nil
}

// Wrote records obj, as the API server returned it from a write of this sidecar. An answer
// that is being deleted and has no finalizer left means the write (the last finalizer's
// removal) let the API server delete the object; it is the last stored copy, at a
// resourceVersion the informer may still show, so no resourceVersion can say the object
// is gone: Get reports it missing until the informer shows the deletion (or holds another
// object of that name). (The kinds the sidecars write have no graceful deletion, which
// keeps an object without finalizers for a while.)
func (w *OwnWrites[T]) Wrote(obj T) {
	if m, err := meta.Accessor(obj); err == nil && m.GetDeletionTimestamp() != nil && len(m.GetFinalizers()) == 0 {
		w.deletedBy(obj, m.GetUID())
		return
	}
	w.cache.Mutation(obj)
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
}

// seenDeleted drops the record of an object the informer saw deleted.
func (w *OwnWrites[T]) seenDeleted(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.deleted, key)
}
