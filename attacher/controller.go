package attacher

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/attacher/csicall"
	"github.com/csi-sidecars/csi-sidecars/attacher/nodeid"
	"github.com/csi-sidecars/csi-sidecars/attacher/patch"
	"github.com/csi-sidecars/csi-sidecars/attacher/pvfinalizer"
	"github.com/csi-sidecars/csi-sidecars/attacher/reconcile"
	"github.com/csi-sidecars/csi-sidecars/attacher/volume"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// config is what the controller is told: flags and what the driver can do.
type config struct {
	driver  string
	timeout time.Duration
	// workers is --worker-threads: the PV workers, and how many VolumeAttachments are
	// attached or detached at once, both kinds together (slots).
	workers int
	// attachWorkers and detachWorkers are the workers of each VolumeAttachment queue
	// (--attach-worker-threads, --detach-worker-threads); 0 is workers.
	attachWorkers      int
	detachWorkers      int
	resync             time.Duration
	retryIntervalStart time.Duration
	retryIntervalMax   time.Duration
	maxEntries         int
	reconcileSync      time.Duration
	defaultFSType      string

	// trivial: the driver cannot publish, so every VolumeAttachment is marked attached
	// at once, with no finalizer and no CSI call.
	trivial               bool
	publishReadOnly       bool
	singleNodeMultiWriter bool
	// reconcile enables the ListVolumes reconciler (LIST_VOLUMES +
	// LIST_VOLUMES_PUBLISHED_NODES).
	reconcile bool
	// errorCodes records the gRPC code in attachError (MutableCSINodeAllocatableCount).
	errorCodes bool
	// queueMetrics is where the queues report; nil is client-go's process-wide provider.
	queueMetrics workqueue.MetricsProvider
	// backlog exports what the queues have waiting (Env.Backlog); nil in most unit tests.
	backlog *lifecycle.Backlog
}

// Queue names label client-go's process-wide workqueue metrics
// (workqueue_depth{name="csi-attacher-va"}, ...), and no other queue of the process uses
// them. The attach queue keeps the name of upstream's one VolumeAttachment queue
// (NewCSIAttachController): attaches are what Pods wait for to start, which is what
// dashboards and alerts on that queue watch; the detach queue is new, named after it.
const (
	vaQueueName       = "csi-attacher-va"
	vaDetachQueueName = "csi-attacher-va-detach"
	pvQueueName       = "csi-attacher-pv"
)

// Controller attaches and detaches the VolumeAttachments of one driver: it queues them by
// the work they need, runs the workers and hands each VolumeAttachment to the syncer. The
// parts below attacher/ do the rest: the writes (patch), the driver calls (csicall), node
// IDs (nodeid), the PVs' finalizer (pvfinalizer) and the reconciler (reconcile).
type Controller struct {
	config
	// ops is the parent of every sync's context: CSI call and the writes recording it (P1).
	ops context.Context

	vaLister storagelisters.VolumeAttachmentLister
	pvLister corelisters.PersistentVolumeLister
	// attachQueue and detachQueue hold VolumeAttachments by the kind of work they need
	// (kindOf); the trivial handler has no detachQueue and no pvQueue.
	attachQueue *lifecycle.Queue[string]
	detachQueue *lifecycle.Queue[string]
	pvQueue     *lifecycle.Queue[string]
	guard       *vaGuard
	slots       *slots
	// leading is set once this replica works (run). Until then the handlers queue only
	// VolumeAttachments that need work (needsWork), so that a standby that takes over
	// starts on them and not behind a no-op sync of every settled VolumeAttachment.
	leading atomic.Bool
	// forced are the VolumeAttachments whose next sync calls the driver (the reconciler's).
	forced *forcedSyncs
	// vas is the VolumeAttachment cache read through this controller's own writes
	// (lifecycle.OwnWrites): a sync that follows a write of ours before its watch event
	// arrived starts from what we wrote, not from the copy it replaced, which would call
	// the driver and write the status again for nothing (upstream does).
	vas *lifecycle.OwnWrites[*storagev1.VolumeAttachment]

	// calls go to the driver's controller service, the syncer's and the reconciler's.
	calls *csicall.Driver
	// syncer does what a VolumeAttachment asks for: publish or unpublish, and record it.
	syncer *syncer
	// pvFinalizers and reconciler are nil for the trivial handler.
	pvFinalizers *pvfinalizer.Releaser
	reconciler   *reconcile.Reconciler
}

// newController builds the controller and registers its handlers on factory. Handlers only
// enqueue: they run on standbys too, so a new leader starts with every VolumeAttachment
// that needs work already queued (P7).
func newController(cfg config, kube kubernetes.Interface, factory informers.SharedInformerFactory, conn grpc.ClientConnInterface, tr volume.Translator, ops context.Context) (*Controller, error) {
	if cfg.attachWorkers == 0 {
		cfg.attachWorkers = cfg.workers
	}
	if cfg.detachWorkers == 0 {
		cfg.detachWorkers = cfg.workers
	}
	c := &Controller{
		config: cfg,
		ops:    ops,
		guard:  newVAGuard(),
		slots:  newSlots(cfg.workers),
		forced: newForcedSyncs(),
		calls:  &csicall.Driver{Client: csi.NewControllerClient(conn), Timeout: cfg.timeout, MaxEntries: cfg.maxEntries},
	}
	c.attachQueue = c.newQueue(vaQueueName)
	if !cfg.trivial {
		c.detachQueue = c.newQueue(vaDetachQueueName)
	}
	vas := factory.Storage().V1().VolumeAttachments()
	c.vaLister = vas.Lister()
	var err error
	if c.vas, err = lifecycle.NewOwnWrites[*storagev1.VolumeAttachment](klog.FromContext(ops), vas.Informer()); err != nil {
		return nil, fmt.Errorf("VolumeAttachment cache: %w", err)
	}
	if _, err := vas.Informer().AddEventHandlerWithResyncPeriod(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.vaAdded,
		UpdateFunc: c.vaUpdated,
		DeleteFunc: c.vaDeleted,
	}, cfg.resync); err != nil {
		return nil, fmt.Errorf("watching VolumeAttachments: %w", err)
	}
	c.syncer = &syncer{config: cfg, kube: kube, tr: tr, calls: c.calls}
	if cfg.trivial {
		// No PV queue: the trivial handler puts no finalizer on PVs (upstream creates the
		// queue anyway, so its workqueue series exist there with nothing to do).
		c.syncer.write = patch.New(kube, c.vas, nil, cfg.driver, cfg.errorCodes)
		return c, nil
	}
	c.pvQueue = c.newQueue(pvQueueName)
	pvs := factory.Core().V1().PersistentVolumes()
	c.pvLister = pvs.Lister()
	if c.syncer.pvs, err = lifecycle.NewOwnWrites[*corev1.PersistentVolume](klog.FromContext(ops), pvs.Informer()); err != nil {
		return nil, fmt.Errorf("PersistentVolume cache: %w", err)
	}
	c.syncer.write = patch.New(kube, c.vas, c.syncer.pvs, cfg.driver, cfg.errorCodes)
	if c.pvFinalizers, err = pvfinalizer.New(pvfinalizer.Config{
		Driver:     cfg.driver,
		Ops:        ops,
		Translator: tr,
		PVs:        c.syncer.pvs,
		VAs:        c.vaLister,
		Patch:      c.syncer.write.PV,
	}, c.pvQueue, pvs.Informer(), vas.Informer(), cfg.resync); err != nil {
		return nil, err
	}
	nodes := nodeid.New(cfg.driver, factory.Storage().V1().CSINodes().Lister(), kube)
	c.syncer.nodes = nodes
	c.reconciler = reconcile.New(reconcile.Config{
		Driver:     cfg.driver,
		Ops:        ops,
		Interval:   cfg.reconcileSync,
		VAs:        c.vaLister,
		PVs:        c.pvLister,
		Translator: tr,
		NodeID:     nodes.Cached,
		List:       c.calls.ListPublished,
		Force: func(va *storagev1.VolumeAttachment) {
			c.forced.set(va.Name)
			c.enqueue(va)
		},
	})
	return c, nil
}

// newQueue builds one of the controller's queues, its backlog exported
// (csi_sidecars_queue_waiting_items{sidecar="attacher",queue=name}).
func (c *Controller) newQueue(name string) *lifecycle.Queue[string] {
	return lifecycle.NewQueue[string](lifecycle.QueueOptions{
		Name:       name,
		RetryStart: c.retryIntervalStart,
		RetryMax:   c.retryIntervalMax,
		Metrics:    c.queueMetrics,
		Backlog:    c.backlog,
	})
}

// run works while intake lasts: attach, detach and PV workers, and the reconciler. It
// returns once every worker finished the item it holds.
func (c *Controller) run(intake context.Context) {
	c.syncer.intake = intake
	c.leading.Store(true)
	var wg sync.WaitGroup
	for _, k := range []kind{attachKind, detachKind} {
		q, n := c.queue(k), c.attachWorkers
		if k == detachKind {
			n = c.detachWorkers
		}
		if q == nil {
			continue // the trivial handler's detach queue
		}
		wg.Go(func() {
			lifecycle.RunWorkers(intake, q, n, func(name string) error { return c.processVA(intake, k, name) })
		})
	}
	if !c.trivial {
		wg.Go(func() { lifecycle.RunWorkers(intake, c.pvQueue, c.workers, c.pvFinalizers.Sync) })
	}
	if c.reconcile && !c.trivial {
		wg.Go(func() { c.reconciler.Run(intake) })
	}
	wg.Wait()
}

// vaAdded and vaUpdated queue a VolumeAttachment as upstream while this replica leads. A
// standby queues only those that need work: the others are settled and their sync a no-op
// (needsWork mirrors sync), the leader's periodic resync (--resync) still syncs each of them
// within a resync period of taking over, and the reconciler checks them against the driver
// as the term starts. Every change that makes a VolumeAttachment need work reaches the
// standby as an event, and its key stays queued until it leads, so nothing that needs work
// is missed. Without this a standby's queue held every VolumeAttachment (each add, and each
// resync of its own), and fresh work at a takeover waited behind thousands of no-op syncs.
func (c *Controller) vaAdded(obj any) {
	if va, ok := obj.(*storagev1.VolumeAttachment); ok && va.Spec.Attacher == c.driver && (c.leading.Load() || c.needsWork(va)) {
		c.enqueue(va)
	}
}

func (c *Controller) vaUpdated(old, obj any) {
	oldVA, ok1 := old.(*storagev1.VolumeAttachment)
	va, ok2 := obj.(*storagev1.VolumeAttachment)
	if ok1 && ok2 && va.Spec.Attacher == c.driver && shouldEnqueueVAChange(oldVA, va) && (c.leading.Load() || c.needsWork(va)) {
		c.enqueue(va)
	}
}

// vaDeleted forgets a forced sync of the VolumeAttachment. (The PV's finalizer is the
// pvfinalizer's: it watches deletions too.)
func (c *Controller) vaDeleted(obj any) {
	if gone, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = gone.Obj
	}
	if va, ok := obj.(*storagev1.VolumeAttachment); ok {
		c.forced.consume(va.Name)
	}
}

// shouldEnqueueVAChange filters out updates that only changed attachError or detachError:
// those are this controller's own writes, and processing them again would call the driver
// again at once, defeating the exponential backoff.
func shouldEnqueueVAChange(old, updated *storagev1.VolumeAttachment) bool {
	if old.ResourceVersion == updated.ResourceVersion {
		return true // periodic resync
	}
	if old.Status.AttachError == nil && old.Status.DetachError == nil &&
		updated.Status.AttachError == nil && updated.Status.DetachError == nil {
		return true
	}
	sanitized := updated.DeepCopy()
	sanitized.ResourceVersion = old.ResourceVersion
	sanitized.ManagedFields = old.ManagedFields
	sanitized.Status.AttachError = old.Status.AttachError
	sanitized.Status.DetachError = old.Status.DetachError
	return !equality.Semantic.DeepEqual(old, sanitized)
}

// syncVA brings one VolumeAttachment to what it asks for, whatever the kind (the workers
// go through processVA). An error requeues it with per-item exponential backoff.
func (c *Controller) syncVA(name string) error {
	va, err := c.cachedVA(name)
	if va == nil || err != nil {
		return c.gone(name, err)
	}
	return c.sync(va)
}

// gone ends the sync of name after cachedVA returned no VolumeAttachment: when that is
// because it is gone (err nil), a sync the reconciler forced is forgotten. The reconciler
// may flag a VolumeAttachment from its list after the deletion event already went by.
func (c *Controller) gone(name string, err error) error {
	if err == nil {
		c.forced.consume(name)
	}
	return err
}

// cachedVA is the VolumeAttachment name as the cache or this controller's last write of it
// knows it, the newer; nil when it is gone or another driver's.
func (c *Controller) cachedVA(name string) (*storagev1.VolumeAttachment, error) {
	va, ok, err := c.vas.Get(name)
	if err != nil {
		return nil, fmt.Errorf("getting VolumeAttachment %s from the cache: %w", name, err)
	}
	if !ok || va.Spec.Attacher != c.driver {
		return nil, nil
	}
	return va, nil
}

// sync brings va, as cached, to what it asks for.
func (c *Controller) sync(va *storagev1.VolumeAttachment) error {
	name := va.Name
	logger := klog.FromContext(c.ops).WithValues("VolumeAttachment", name)
	// P1: the CSI call and the writes that record it run on Ops(), never on intake. The
	// CSI call has --timeout; API requests wait for their token of the client budget as
	// long as it takes (P14), and client-go bounds each once sent.
	ctx := klog.NewContext(c.ops, logger)
	forced := c.forced.consume(name)
	if c.trivial {
		return c.syncer.trivial(ctx, va)
	}
	if va.DeletionTimestamp == nil {
		return c.syncer.attach(ctx, va, forced)
	}
	return c.syncer.detach(ctx, va, forced)
}
