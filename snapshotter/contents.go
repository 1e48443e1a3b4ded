package snapshotter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// controllerConfig configures a controller of either kind: its clients, the driver, the
// queue's retries and the names of the snapshots it takes.
type controllerConfig struct {
	clients      *clients
	driver       *driver
	recorder     record.EventRecorder
	resync       time.Duration
	retryStart   time.Duration
	retryMax     time.Duration
	backlog      *lifecycle.Backlog
	extraCreate  bool
	namePrefix   string
	nameUUIDSize int
}

// object is a kind of content this sidecar owns: VolumeSnapshotContent or
// VolumeGroupSnapshotContent.
type object interface {
	runtime.Object
	metav1.Object
}

// patchFunc is a typed client's Patch.
type patchFunc[T object] func(ctx context.Context, name string, pt types.PatchType, data []byte, opts metav1.PatchOptions, subresources ...string) (T, error)

// contents is what the two controllers share for their kind T: the cache read through this
// sidecar's own writes, the queue and its workers, the writes (patches of only what
// changes, from the cached copy, never from a GET made for the write; each answer goes back
// into OwnWrites), and the snapshots this process deleted.
type contents[T object] struct {
	kind     string // for logs and errors
	own      *lifecycle.OwnWrites[T]
	queue    *lifecycle.Queue[string]
	synced   []cache.InformerSynced
	patcher  patchFunc[T]
	recorder record.EventRecorder

	mu sync.Mutex
	// deleted holds, by name, the UIDs of the objects whose snapshot this process deleted
	// and whose finalizer is still on: a retry of the finalizer's removal does not call the
	// driver again.
	deleted map[string]types.UID
}

// contentsConfig is what newContents needs besides the informers.
type contentsConfig[T object] struct {
	kind     string
	queue    lifecycle.QueueOptions
	resync   time.Duration
	patcher  patchFunc[T]
	recorder record.EventRecorder
	rules    kindRules[T]
}

// kindRules say what in an object of kind T is the sidecar's own to write.
type kindRules[T object] struct {
	creating  string       // the kind's being-created annotation
	ready     func(T) bool // whether the object's snapshot is ready to use
	dropState func(T)      // clears the object's status
	// wake, if set, names further updates that need work although they change only what
	// is otherwise the sidecar's own.
	wake func(old, obj T) bool
}

func newContents[T object](cfg contentsConfig[T], informer cache.SharedIndexInformer, classSynced cache.InformerSynced) (*contents[T], error) {
	c := &contents[T]{
		kind:     cfg.kind,
		queue:    lifecycle.NewQueue[string](cfg.queue),
		synced:   []cache.InformerSynced{informer.HasSynced, classSynced},
		patcher:  cfg.patcher,
		recorder: cfg.recorder,
		deleted:  map[string]types.UID{},
	}
	own, err := lifecycle.NewOwnWrites[T](klog.Background(), informer)
	if err != nil {
		return nil, fmt.Errorf("%s cache: %w", cfg.kind, err)
	}
	c.own = own
	_, err = informer.AddEventHandlerWithResyncPeriod(cache.ResourceEventHandlerFuncs{
		AddFunc: c.enqueue,
		UpdateFunc: func(old, obj any) {
			o, ok1 := old.(T)
			n, ok2 := obj.(T)
			if ok1 && ok2 && !changed(o, n, cfg.rules) {
				return
			}
			c.enqueue(obj)
		},
		DeleteFunc: c.enqueue,
	}, cfg.resync)
	return c, err
}

func (c *contents[T]) enqueue(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	if m, err := meta.Accessor(obj); err == nil {
		c.queue.Add(m.GetName())
	}
}

// changed tells whether an update may need work: anything but this sidecar's own writes
// (status, finalizers, the being-created annotation), a resync, or the snapshot turning
// ready (a deletion requested while it was being taken waits for that: upstream's issue
// 1388).
func changed[T object](old, obj T, cfg kindRules[T]) bool {
	if old.GetResourceVersion() == obj.GetResourceVersion() || (!cfg.ready(old) && cfg.ready(obj)) {
		return true
	}
	if cfg.wake != nil && cfg.wake(old, obj) {
		return true
	}
	a, b := old.DeepCopyObject().(T), obj.DeepCopyObject().(T)
	for _, o := range []T{a, b} {
		o.SetResourceVersion("")
		o.SetManagedFields(nil)
		o.SetFinalizers(nil)
		cfg.dropState(o)
		annotations := o.GetAnnotations()
		delete(annotations, cfg.creating)
		if len(annotations) == 0 {
			o.SetAnnotations(nil)
		}
	}
	return !equality.Semantic.DeepEqual(a, b)
}

// run waits for the caches, then runs workers on the queue until intake ends; sync gets
// the object as this sidecar knows it (nothing for one that is gone).
func (c *contents[T]) run(intake, ops context.Context, workers int, sync func(intake, ops context.Context, obj T) error) {
	if !cache.WaitForCacheSync(intake.Done(), c.synced...) {
		return
	}
	lifecycle.RunWorkers(intake, c.queue, workers, func(name string) error {
		err := c.step(intake, ops, name, sync)
		if err != nil && !errors.Is(err, errPending) && !lifecycle.NotStarted(err) {
			klog.FromContext(ops).Error(err, "Syncing "+c.kind, "name", name)
		}
		return err
	})
}

// step is one worker's turn on the object called name.
func (c *contents[T]) step(intake, ops context.Context, name string, sync func(intake, ops context.Context, obj T) error) error {
	obj, exists, err := c.own.Get(name)
	if err != nil {
		return err
	}
	if !exists {
		c.forgetDeleted(name)
		return nil
	}
	return sync(intake, ops, obj)
}

// contentDeletionDue tells whether the snapshot of a content of either kind may be deleted
// now: the content is being deleted, no create may still run for it (no creating
// annotation), and the snapshot-controller has agreed (the agreed annotation), or it is a
// pre-provisioned content never bound (unbound).
func contentDeletionDue(obj metav1.Object, unbound bool, creating, agreed string) bool {
	if obj.GetDeletionTimestamp() == nil {
		return false
	}
	if unbound {
		return true
	}
	if _, ok := obj.GetAnnotations()[creating]; ok {
		return false
	}
	_, ok := obj.GetAnnotations()[agreed]
	return ok
}

// readiness adds to patch the readiness the driver reported when the status says
// otherwise (was), and clears the status's error once the snapshot is ready (hasError).
func readiness(patch fields, was *bool, hasError, ready bool) {
	if was == nil || *was != ready {
		patch["readyToUse"] = ready
		if ready && hasError {
			patch["error"] = nil
		}
	}
}

// fields is a patch's content.
type fields = map[string]any

// patch sends one patch and records its answer.
func (c *contents[T]) patch(ctx context.Context, name string, pt types.PatchType, patch any, subresources ...string) (T, error) {
	data, err := json.Marshal(patch)
	if err != nil {
		var zero T
		return zero, err
	}
	out, err := c.patcher(ctx, name, pt, data, metav1.PatchOptions{}, subresources...)
	if err != nil {
		var zero T
		return zero, fmt.Errorf("patching %s %s: %w", c.kind, name, err)
	}
	c.own.Wrote(out)
	return out, nil
}

// mark puts the being-created annotation key on obj (ctx: StartingWork), or takes it off,
// unless it already is so.
func (c *contents[T]) mark(ctx context.Context, obj T, key string, on bool) (T, error) {
	if _, has := obj.GetAnnotations()[key]; has == on {
		return obj, nil
	}
	var value any // nil removes the key in a merge patch
	if on {
		value = "yes"
	}
	return c.patch(ctx, obj.GetName(), types.MergePatchType, fields{"metadata": fields{"annotations": fields{key: value}}})
}

// patchStatus merges status into obj's status.
func (c *contents[T]) patchStatus(ctx context.Context, obj T, status fields) (T, error) {
	return c.patch(ctx, obj.GetName(), types.MergePatchType, fields{"status": status}, "status")
}

// failed records a failure on obj's status and as an event, unless the status already
// says the same (same is the message already recorded, if any).
func (c *contents[T]) failed(ctx context.Context, obj T, same *string, reason, message string) {
	if same != nil && *same == message {
		return
	}
	if _, err := c.patchStatus(ctx, obj, fields{"readyToUse": false, "error": fields{"time": metav1.Now(), "message": message}}); err != nil {
		klog.FromContext(ctx).Error(err, "Recording the failure on the "+c.kind, "name", obj.GetName())
	}
	c.recorder.Event(obj, v1.EventTypeWarning, reason, message)
}

// release removes finalizer once the snapshot is deleted (or kept by policy), and forgets
// the deletion. Where obj outlives it (another finalizer) and this process deleted its
// snapshot, clear is merged into its status, as upstream clears the status before its own
// finalizer removal.
func (c *contents[T]) release(ctx context.Context, obj T, finalizer string, clear fields) error {
	deleted := c.wasDeleted(obj)
	if i := slices.Index(obj.GetFinalizers(), finalizer); i >= 0 {
		// Remove this finalizer where it is, unless the list moved meanwhile (a conflict,
		// retried from the queue): other finalizers are others' to keep.
		path := fmt.Sprintf("/metadata/finalizers/%d", i)
		out, err := c.patch(ctx, obj.GetName(), types.JSONPatchType, []fields{
			{"op": "test", "path": path, "value": finalizer},
			{"op": "remove", "path": path},
		})
		if err != nil {
			return err
		}
		obj = out
	}
	if deleted && len(obj.GetFinalizers()) > 0 && clear != nil {
		if _, err := c.patchStatus(ctx, obj, clear); err != nil {
			return err
		}
	}
	c.forgetDeleted(obj.GetName())
	return nil
}

func (c *contents[T]) wasDeleted(obj T) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	uid, ok := c.deleted[obj.GetName()]
	return ok && uid == obj.GetUID()
}

func (c *contents[T]) noteDeleted(obj T) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.deleted[obj.GetName()] = obj.GetUID()
}

// forgetDeleted drops what deleted holds for an object that is gone or released.
func (c *contents[T]) forgetDeleted(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.deleted, name)
}
