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
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

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

// Controller attaches and detaches the VolumeAttachments of one driver.
type Controller struct {
	config
	kube kubernetes.Interface
	csi  csi.ControllerClient
	tr   translator
	// ops is the parent of every sync's context: CSI call and the writes recording it (P1).
	ops context.Context

	vaLister      storagelisters.VolumeAttachmentLister
	pvLister      corelisters.PersistentVolumeLister
	csiNodeLister storagelisters.CSINodeLister
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
	// intake is run's, set before its workers start: the writes that start an attach end
	// with it (startingWork).
	intake context.Context

	// forceSync names VolumeAttachments the reconciler found out of step with the driver:
	// their next sync calls the driver even though their status looks done. A name leaves
	// at that sync, when the sync finds the VolumeAttachment gone, or at its deletion, so
	// the map holds no more names than there are VolumeAttachments.
	mu        sync.Mutex
	forceSync map[string]bool
	// vas and pvs are the VolumeAttachment and PV caches read through this controller's
	// own writes (lifecycle.OwnWrites): a sync that follows a write of ours before its
	// watch event arrived starts from what we wrote, not from the copy it replaced, which
	// would call the driver and write the status again for nothing (upstream does).
	vas *lifecycle.OwnWrites[*storagev1.VolumeAttachment]
	pvs *lifecycle.OwnWrites[*corev1.PersistentVolume]
}

// newController builds the controller and registers its handlers on factory. Handlers only
// enqueue: they run on standbys too, so a new leader starts with every VolumeAttachment
// that needs work already queued (P7).
func newController(cfg config, kube kubernetes.Interface, factory informers.SharedInformerFactory, conn grpc.ClientConnInterface, tr translator, ops context.Context) (*Controller, error) {
	if cfg.attachWorkers == 0 {
		cfg.attachWorkers = cfg.workers
	}
	if cfg.detachWorkers == 0 {
		cfg.detachWorkers = cfg.workers
	}
	c := &Controller{
		config:    cfg,
		kube:      kube,
		csi:       csi.NewControllerClient(conn),
		tr:        tr,
		ops:       ops,
		guard:     newVAGuard(),
		slots:     newSlots(cfg.workers),
		forceSync: map[string]bool{},
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
	if cfg.trivial {
		// No PV queue: the trivial handler puts no finalizer on PVs (upstream creates the
		// queue anyway, so its workqueue series exist there with nothing to do).
		return c, nil
	}
	c.pvQueue = c.newQueue(pvQueueName)
	pvs := factory.Core().V1().PersistentVolumes()
	c.pvLister = pvs.Lister()
	if c.pvs, err = lifecycle.NewOwnWrites[*corev1.PersistentVolume](klog.FromContext(ops), pvs.Informer()); err != nil {
		return nil, fmt.Errorf("PersistentVolume cache: %w", err)
	}
	if _, err := pvs.Informer().AddEventHandlerWithResyncPeriod(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.pvChanged,
		UpdateFunc: func(_, obj any) { c.pvChanged(obj) },
	}, cfg.resync); err != nil {
		return nil, fmt.Errorf("watching PersistentVolumes: %w", err)
	}
	c.csiNodeLister = factory.Storage().V1().CSINodes().Lister()
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
	c.intake = intake
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
		wg.Go(func() { lifecycle.RunWorkers(intake, c.pvQueue, c.workers, c.syncPV) })
	}
	if c.reconcile && !c.trivial {
		wg.Go(func() { c.runReconciler(intake) })
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

// vaDeleted forgets a forced sync of the VolumeAttachment and lets the PV's finalizer go
// once no VolumeAttachment needs it.
func (c *Controller) vaDeleted(obj any) {
	if gone, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = gone.Obj
	}
	va, ok := obj.(*storagev1.VolumeAttachment)
	if ok {
		c.consumeForceSync(va.Name)
	}
	if ok && c.pvQueue != nil && va.Spec.Source.PersistentVolumeName != nil {
		c.pvQueue.Add(*va.Spec.Source.PersistentVolumeName)
	}
}

func (c *Controller) pvChanged(obj any) {
	if pv, ok := obj.(*corev1.PersistentVolume); ok && c.pvFinalizerMayGo(pv) {
		c.pvQueue.Add(pv.Name)
	}
}

// pvFinalizerMayGo tells whether a PV carries our finalizer and no longer needs it unless
// a VolumeAttachment uses it: the PV is being deleted, or it is an in-tree PV that is not
// (or no longer) migrated to this driver, for example after a rollback of migration.
func (c *Controller) pvFinalizerMayGo(pv *corev1.PersistentVolume) bool {
	if !hasFinalizer(pv.Finalizers, finalizerName(c.driver)) {
		return false
	}
	if pv.DeletionTimestamp != nil {
		return true
	}
	return c.tr.IsPVMigratable(pv) && pv.Annotations[migratedToAnnotation] != c.driver
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
		c.consumeForceSync(name)
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
	forced := c.consumeForceSync(name)
	if c.trivial {
		return c.syncTrivial(ctx, va)
	}
	if va.DeletionTimestamp == nil {
		return c.syncAttach(ctx, va, forced)
	}
	return c.syncDetach(ctx, va, forced)
}

// syncTrivial marks a VolumeAttachment attached without a CSI call or a finalizer: the
// driver has nothing to publish.
func (c *Controller) syncTrivial(ctx context.Context, va *storagev1.VolumeAttachment) error {
	if va.Status.Attached {
		return nil
	}
	if _, err := c.markAttached(ctx, va, nil); err != nil {
		return fmt.Errorf("failed to mark as attached: %w", err)
	}
	return nil
}

func (c *Controller) syncAttach(ctx context.Context, va *storagev1.VolumeAttachment, forced bool) error {
	if va.Status.Attached && !forced {
		return nil
	}
	logger := klog.FromContext(ctx)
	logger.V(2).Info("Attaching")
	va, metadata, err := c.attach(ctx, va)
	if err != nil {
		c.recordFailure(ctx, va, err, func(s *storagev1.VolumeAttachmentStatus, ve *storagev1.VolumeError) {
			s.AttachError = ve
		})
		return fmt.Errorf("failed to attach: %w", err)
	}
	logger.V(2).Info("Attached")
	if _, err := c.markAttached(ctx, va, metadata); err != nil {
		return fmt.Errorf("failed to mark as attached: %w", err)
	}
	return nil
}

// attach checks everything it can before it adds the finalizer (which would block the
// VolumeAttachment's deletion), then publishes. It returns the VolumeAttachment as last
// written.
func (c *Controller) attach(ctx context.Context, va *storagev1.VolumeAttachment) (*storagev1.VolumeAttachment, map[string]string, error) {
	vol, err := c.volumeToAttach(ctx, va)
	if err != nil {
		return va, nil, err
	}
	readonly := vol.source.ReadOnly && c.publishReadOnly // the spec: false unless PUBLISH_READONLY
	capability, err := volumeCapability(vol.spec, c.singleNodeMultiWriter, c.defaultFSType)
	if err != nil {
		return va, nil, err
	}
	secrets, err := c.secrets(ctx, vol.source.ControllerPublishSecretRef)
	if err != nil {
		return va, nil, err
	}
	nodeID, err := c.nodeID(ctx, va, false)
	if err != nil {
		return va, nil, err
	}
	clone := va.DeepCopy()
	if !hasFinalizer(clone.Finalizers, finalizerName(c.driver)) {
		clone.Finalizers = append(clone.Finalizers, finalizerName(c.driver))
	}
	if clone.Annotations[nodeIDAnnotation] != nodeID {
		if clone.Annotations == nil {
			clone.Annotations = map[string]string{}
		}
		clone.Annotations[nodeIDAnnotation] = nodeID
	}
	wctx, cancel := c.startingWork(ctx)
	va, err = c.patchVA(wctx, va, clone, false)
	cancel()
	if err != nil {
		return va, nil, lifecycle.IfNotStarted(wctx, fmt.Errorf("could not save VolumeAttachment: %w", err))
	}
	req := &csi.ControllerPublishVolumeRequest{
		VolumeId:         vol.source.VolumeHandle,
		NodeId:           nodeID,
		VolumeCapability: capability,
		Readonly:         readonly,
		VolumeContext:    vol.source.VolumeAttributes,
		Secrets:          secrets,
	}
	callCtx, cancel := context.WithTimeout(lifecycle.MarkMigrated(ctx, vol.migrated), c.timeout)
	defer cancel()
	// csi-lib-utils' interceptor on the connection logs the call at -v=5, as upstream's.
	rsp, err := c.csi.ControllerPublishVolume(callCtx, req)
	if err != nil {
		return va, nil, err
	}
	return va, rsp.GetPublishContext(), nil
}

// startingWork is the context of the writes that start an attach (the finalizers): they
// end with intake and wait behind the writes that finish work (P14).
func (c *Controller) startingWork(ctx context.Context) (context.Context, context.CancelFunc) {
	intake := c.intake
	if intake == nil {
		// Tests that sync without run.
		intake = context.Background()
	}
	return lifecycle.StartingWork(ctx, intake)
}

// volumeToAttach resolves the volume and, for a PV, refuses one being deleted and adds our
// finalizer to it, so the PV outlives the attachment.
func (c *Controller) volumeToAttach(ctx context.Context, va *storagev1.VolumeAttachment) (*volume, error) {
	if vol, inline, err := inlineVolume(va); inline {
		return vol, err
	}
	pv, err := c.cachedPV(*va.Spec.Source.PersistentVolumeName)
	if err != nil {
		return nil, err
	}
	if pv.DeletionTimestamp != nil {
		return nil, fmt.Errorf("PersistentVolume %q is marked for deletion", pv.Name)
	}
	if !hasFinalizer(pv.Finalizers, finalizerName(c.driver)) {
		clone := pv.DeepCopy()
		clone.Finalizers = append(clone.Finalizers, finalizerName(c.driver))
		wctx, cancel := c.startingWork(ctx)
		defer cancel()
		if pv, err = c.patchPV(wctx, pv, clone); err != nil {
			return nil, lifecycle.IfNotStarted(wctx, fmt.Errorf("could not add PersistentVolume finalizer: %w", err))
		}
	}
	return pvVolume(klog.FromContext(ctx), c.tr, pv)
}

func (c *Controller) syncDetach(ctx context.Context, va *storagev1.VolumeAttachment, forced bool) error {
	if !hasFinalizer(va.Finalizers, finalizerName(c.driver)) && !forced {
		return nil
	}
	logger := klog.FromContext(ctx)
	logger.V(2).Info("Detaching")
	if err := c.detach(ctx, va); err != nil {
		c.recordFailure(ctx, va, err, func(s *storagev1.VolumeAttachmentStatus, ve *storagev1.VolumeError) {
			ve.ErrorCode = nil // upstream records the code of attach errors only
			s.DetachError = ve
		})
		return fmt.Errorf("failed to detach: %w", err)
	}
	logger.V(2).Info("Detached")
	// Every write is recorded as it returns (patchVA), also when the status write failed
	// after the finalizer was removed: a retry from a stale copy, which still shows the
	// finalizer, would unpublish again.
	return c.markDetached(ctx, va)
}

func (c *Controller) detach(ctx context.Context, va *storagev1.VolumeAttachment) error {
	vol, inline, err := inlineVolume(va)
	if err != nil {
		return err
	}
	if !inline {
		pv, err := c.cachedPV(*va.Spec.Source.PersistentVolumeName)
		if err != nil {
			return err
		}
		if vol, err = pvVolume(klog.FromContext(ctx), c.tr, pv); err != nil {
			return err
		}
	}
	secrets, err := c.secrets(ctx, vol.source.ControllerPublishSecretRef)
	if err != nil {
		return err
	}
	nodeID, err := c.nodeID(ctx, va, true)
	if err != nil {
		return err
	}
	req := &csi.ControllerUnpublishVolumeRequest{VolumeId: vol.source.VolumeHandle, NodeId: nodeID, Secrets: secrets}
	callCtx, cancel := context.WithTimeout(lifecycle.MarkMigrated(ctx, vol.migrated), c.timeout)
	defer cancel()
	_, err = c.csi.ControllerUnpublishVolume(callCtx, req)
	return err
}

// recordFailure writes the error into the status (set puts it in place). A failed write
// is only logged: the error is retried anyway.
//
// No Event, as upstream: the status is where the error is read. kube-controller-manager
// waits on that status and reports a failed attach as a FailedAttachVolume Event on the
// Pods that wait for the volume, where users look; and upstream's RBAC, which drop-in users
// keep, does not grant the attacher events at all.
func (c *Controller) recordFailure(ctx context.Context, va *storagev1.VolumeAttachment, err error, set func(*storagev1.VolumeAttachmentStatus, *storagev1.VolumeError)) {
	if lifecycle.NotStarted(err) {
		// The call never reached the driver (draining, or no longer leading): no error to
		// show, and no write to spend on it; the next leader does the work.
		return
	}
	clone := va.DeepCopy()
	set(&clone.Status, volumeError(err, c.errorCodes, metav1.Now()))
	if _, saveErr := c.patchVA(ctx, va, clone, true); saveErr != nil {
		klog.FromContext(ctx).V(2).Info("Failed to save the error", "err", saveErr.Error())
	}
}

// secrets reads the ControllerPublishSecretRef secret; nil without one.
func (c *Controller) secrets(ctx context.Context, ref *corev1.SecretReference) (map[string]string, error) {
	if ref == nil {
		return nil, nil
	}
	secret, err := lifecycle.GetSecret(ctx, c.kube, ref.Namespace, ref.Name)
	if err != nil {
		return nil, fmt.Errorf("failed to load secret \"%s/%s\": %w", ref.Namespace, ref.Name, err)
	}
	out := make(map[string]string, len(secret.Data))
	for k, v := range secret.Data {
		out[k] = string(v)
	}
	return out, nil
}

// nodeID finds the driver's ID of the VolumeAttachment's node: from the CSINode, else
// (detaching) from the ID recorded on the VolumeAttachment when it was published, else from
// the Node's older csi.volume.kubernetes.io/nodeid annotation.
func (c *Controller) nodeID(ctx context.Context, va *storagev1.VolumeAttachment, detaching bool) (string, error) {
	nodeName := va.Spec.NodeName
	csiNode, err := c.csiNodeLister.Get(nodeName)
	if err == nil {
		if id, ok := nodeIDFromCSINode(c.driver, csiNode); ok {
			return id, nil
		}
		// A CSINode without the driver is what a node whose driver pod is gone looks like;
		// unpublish must still be possible then.
		err = fmt.Errorf("CSINode %s does not contain driver %s", nodeName, c.driver)
	}
	if detaching {
		if id, ok := va.Annotations[nodeIDAnnotation]; ok {
			return id, nil
		}
	}
	node, getErr := c.kube.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if getErr == nil {
		if id, ok := nodeIDFromNode(c.driver, node); ok {
			return id, nil
		}
	}
	return "", err
}

// cachedPV is the PV name as the cache or this controller's last write of it knows it, the
// newer; a NotFound error when the cache has none.
func (c *Controller) cachedPV(name string) (*corev1.PersistentVolume, error) {
	pv, ok, err := c.pvs.Get(name)
	if err != nil {
		return nil, fmt.Errorf("getting PersistentVolume %s from the cache: %w", name, err)
	}
	if !ok {
		return nil, apierrors.NewNotFound(corev1.Resource("persistentvolumes"), name)
	}
	return pv, nil
}

func (c *Controller) setForceSync(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.forceSync[name] = true
}

// isForced tells whether the reconciler forced the next sync of name, without consuming it.
func (c *Controller) isForced(name string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.forceSync[name]
}

func (c *Controller) consumeForceSync(name string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	forced := c.forceSync[name]
	delete(c.forceSync, name)
	return forced
}

// syncPV removes our finalizer from a PV that may let it go once no VolumeAttachment
// references the PV any more.
func (c *Controller) syncPV(name string) error {
	pv, err := c.cachedPV(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if !c.pvFinalizerMayGo(pv) {
		return nil
	}
	vas, err := c.vaLister.List(labels.Everything())
	if err != nil {
		return fmt.Errorf("listing VolumeAttachments: %w", err)
	}
	for _, va := range vas {
		if pvName := va.Spec.Source.PersistentVolumeName; pvName != nil && *pvName == pv.Name {
			return nil // its deletion enqueues the PV again
		}
	}
	ctx := c.ops
	clone := pv.DeepCopy()
	clone.Finalizers = withoutFinalizer(pv.Finalizers, finalizerName(c.driver))
	if _, err := c.patchPV(ctx, pv, clone); err != nil {
		return fmt.Errorf("removing the finalizer: %w", err)
	}
	klog.FromContext(ctx).V(2).Info("Removed finalizer from PersistentVolume", "PersistentVolume", name)
	return nil
}
