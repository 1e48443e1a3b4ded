package provisioner

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// claimUIDIndex indexes claims by UID: the claim queue is keyed by UID, as upstream, so that
// a claim deleted and re-created under the same name is another piece of work.
const claimUIDIndex = "csi-sidecars-provisioner-uid"

// Upstream's queue names (sig-storage-lib-external-provisioner), the label of the
// workqueue metrics.
const (
	claimQueueName  = "claims"
	volumeQueueName = "volumes"
	// sourceQueueName is ours: upstream removes source finalizers inline.
	sourceQueueName = "provisioner-sources"
)

// config is what the controller needs from the outside world; Setup fills it from the
// core's Env, tests fill it themselves.
type config struct {
	opts   options
	driver string
	// inTree is the in-tree plugin the driver replaces (CSI migration), "" for none.
	inTree   string
	identity string // this instance, recorded in volume attributes
	kube     kubernetes.Interface
	csi      csi.ControllerClient
	ops      context.Context // parent of every CSI call and the writes recording it (P1)
	recorder record.EventRecorder
	// eventSource is the recorder's source, also that of the record's events.
	eventSource    v1.EventSource
	metrics        *controllerMetrics
	pluginCaps     rpc.PluginCapabilitySet
	controllerCaps rpc.ControllerCapabilitySet
	topology       bool // the driver reports topology and the Topology gate is on
	vac            bool // the VolumeAttributesClass gate is on
	// node is set with --node-deployment.
	node *nodeDeployment
	// snapshotClient is set when the driver restores snapshots and the cluster serves
	// the VolumeSnapshot API.
	snapshotClient snapclientset.Interface
	// queueMetrics is where the queues report; nil is client-go's process-wide provider.
	queueMetrics workqueue.MetricsProvider
	// backlog is where the queues report what waits for a worker (Env.Backlog); nil: nowhere.
	backlog *lifecycle.Backlog
	// capacity is told which capacity a provisioning or deletion changed; nil without
	// --enable-capacity.
	capacity capacityRefresher
}

// capacityRefresher asks capacity tracking for GetCapacity again, soon rather than at the
// next poll, where a volume was made or deleted: the segments of topology (all of the
// class's for none) of one StorageClass. It only enqueues: it is called on the worker
// that did the operation, and starts nothing.
type capacityRefresher interface {
	refresh(class string, topology []*csi.Topology)
}

// names are the names a claim, class or PersistentVolume may give the driver.
func (c *config) names() driverNames { return driverNames{driver: c.driver, inTree: c.inTree} }

// capacityChanged tells capacity tracking, if on, that an operation changed capacity.
func (c *controller) capacityChanged(class string, topology []*csi.Topology) {
	if c.capacity != nil && class != "" {
		c.capacity.refresh(class, topology)
	}
}

// controller provisions and deletes the driver's volumes: a claim queue and a volume queue,
// fed by informer handlers that only enqueue.
type controller struct {
	config

	claims      cache.Indexer
	classes     storagelisters.StorageClassLister
	volumes     corelisters.PersistentVolumeLister
	nodes       corelisters.NodeLister                // nil without topology
	csiNodes    storagelisters.CSINodeLister          // nil without topology
	attachments storagelisters.VolumeAttachmentLister // nil unless the driver publishes

	claimQueue  *lifecycle.Queue[string]
	volumeQueue *lifecycle.Queue[string]
	// sourceQueue holds sources (claims, snapshots) whose protection finalizer may go,
	// keyed by sourceRef.key().
	sourceQueue *lifecycle.Queue[string]
	// closer writes the events that close records, off the provisioning's path.
	closer closer
	// snapshots is nil without snapshot support.
	snapshots *snapshotWatch
	// records keeps the provisioning records (events on the claims).
	records *recordStore

	// intake is Run's: set before the workers start, it ends waits that start no work.
	intake atomic.Pointer[context.Context]

	// inFlight holds the plan of every CreateVolume about to run or maybe still running.
	inFlight inFlight
	// ownClaims reads the claim cache through this process's own writes of claims
	// (record, reschedule, node selection): a sync that comes before the informer shows
	// one decides on what was written, not on the copy it replaced.
	ownClaims *lifecycle.OwnWrites[*v1.PersistentVolumeClaim]
	// absent remembers recorded volumes the driver answered for good that it does not
	// have, so that their undo needs no CSI call.
	absent absentVolumes
	// slow holds the claims whose CreateVolume was infeasible, to be retried slowly.
	slow slowRetries
	// deletions holds how far this process got with deleting each PersistentVolume, until
	// the informer sees it go: no sync repeats a DeleteVolume or the writes after it.
	deletions deletions
	// ownPVs reads the PersistentVolume cache through the PersistentVolumes this process
	// saved: a sync of the claim can come before the informer shows one, and a claim that
	// looks unprovisioned would be planned, recorded and created again.
	ownPVs *lifecycle.OwnWrites[*v1.PersistentVolume]
}

// newController wires the listers, handlers and queues on factory. It must run before the
// factory starts.
func newController(cfg config, factory informers.SharedInformerFactory) (*controller, error) {
	c := &controller{config: cfg}
	queue := func(name string) *lifecycle.Queue[string] {
		return lifecycle.NewQueue[string](lifecycle.QueueOptions{Name: name, RetryStart: cfg.opts.retryIntervalStart, RetryMax: cfg.opts.retryIntervalMax,
			Metrics: cfg.queueMetrics, Backlog: cfg.backlog})
	}
	// client-go's workqueue metrics are per process, labelled by queue name: the claim and
	// volume queues keep upstream's names (dashboards keep working, P9), which no other
	// sidecar of the process uses; the source queue has no upstream twin.
	c.claimQueue = queue(claimQueueName)
	c.volumeQueue = queue(volumeQueueName)
	c.sourceQueue = queue(sourceQueueName)
	c.closer.queue = queue(closeQueueName)

	claims := factory.Core().V1().PersistentVolumeClaims().Informer()
	if err := claims.AddIndexers(cache.Indexers{claimUIDIndex: func(obj any) ([]string, error) {
		m, err := meta.Accessor(obj)
		if err != nil {
			return nil, err
		}
		return []string{string(m.GetUID())}, nil
	}}); err != nil {
		return nil, fmt.Errorf("indexing claims by UID: %w", err)
	}
	c.claims = claims.GetIndexer()
	own, err := lifecycle.NewOwnWrites[*v1.PersistentVolumeClaim](klog.Background(), claims)
	if err != nil {
		return nil, fmt.Errorf("claim cache: %w", err)
	}
	c.ownClaims = own
	if c.records, err = newRecordStore(cfg.kube, cfg.driver, cfg.eventSource); err != nil {
		return nil, err
	}
	if _, err := c.records.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: c.enqueueRecorded}); err != nil {
		return nil, err
	}
	if _, err := claims.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueueClaim,
		UpdateFunc: func(_, obj any) { c.enqueueClaim(obj) },
		DeleteFunc: c.forgetClaim,
	}); err != nil {
		return nil, err
	}
	if _, err := claims.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueueClaimSources,
		UpdateFunc: func(_, obj any) { c.enqueueClaimSources(obj) },
		DeleteFunc: c.enqueueClaimSources,
	}); err != nil {
		return nil, err
	}
	if cfg.snapshotClient != nil {
		if err := c.watchSnapshots(cfg.snapshotClient); err != nil {
			return nil, err
		}
	}

	c.classes = factory.Storage().V1().StorageClasses().Lister()
	volumes := factory.Core().V1().PersistentVolumes()
	c.volumes = volumes.Lister()
	if _, err := volumes.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueueVolume,
		UpdateFunc: func(_, obj any) { c.enqueueVolume(obj) },
		DeleteFunc: c.forgetDeletedVolume,
	}); err != nil {
		return nil, err
	}
	if c.ownPVs, err = lifecycle.NewOwnCreations[*v1.PersistentVolume](klog.Background(), volumes.Informer()); err != nil {
		return nil, fmt.Errorf("PersistentVolume cache: %w", err)
	}

	if cfg.topology {
		if cfg.node != nil {
			// A node deployment knows its one node; it does not watch the cluster's.
			c.nodes, c.csiNodes = cfg.node.listers(cfg.driver)
		} else {
			c.nodes = factory.Core().V1().Nodes().Lister()
			c.csiNodes = factory.Storage().V1().CSINodes().Lister()
		}
	}
	if cfg.controllerCaps[csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME] {
		// Deletion waits for the volume to be detached everywhere.
		attachments := factory.Storage().V1().VolumeAttachments()
		c.attachments = attachments.Lister()
		if _, err := attachments.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
			DeleteFunc: c.enqueueAttachedVolume,
		}); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func (c *controller) enqueueClaim(obj any) {
	// A claim with a record may be bound, deleted or another provisioner's by now: its
	// volume must still be finished or undone.
	if claim, ok := obj.(*v1.PersistentVolumeClaim); ok && (mayNeedVolume(claim, c.names()) || hasRecord(claim) || c.records.isOpen(string(claim.UID))) {
		c.claimQueue.Add(string(claim.UID))
	}
}

// enqueueRecorded queues the claim of a record event whose record is open: whoever leads
// finishes or undoes it, whether the claim is still there or not.
func (c *controller) enqueueRecorded(obj any) {
	if ev, ok := obj.(*v1.Event); ok {
		if uid := ev.Labels[labelRecordClaim]; uid != "" && c.records.isOpen(uid) {
			c.claimQueue.Add(uid)
		}
	}
}

// forgetClaim drops what this process remembers about a claim that is gone, and queues it
// if its record is open: its volume is undone.
func (c *controller) forgetClaim(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	if claim, ok := obj.(*v1.PersistentVolumeClaim); ok {
		if c.records.isOpen(string(claim.UID)) {
			c.claimQueue.Add(string(claim.UID))
		}
		c.absent.forget(string(claim.UID))
		c.slow.forget(string(claim.UID))
		if c.node != nil {
			// Its lost races no longer delay anything (upstream forgets them too).
			c.node.forget(string(claim.UID))
		}
	}
}

func (c *controller) enqueueVolume(obj any) {
	if pv, ok := obj.(*v1.PersistentVolume); ok && isDriverVolume(pv, c.names()) {
		c.volumeQueue.Add(pv.Name)
	}
}

// enqueueAttachedVolume wakes a deletion that waits for this attachment to go.
func (c *controller) enqueueAttachedVolume(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	if va, ok := obj.(*storagev1.VolumeAttachment); ok && va.Spec.Source.PersistentVolumeName != nil {
		c.volumeQueue.Add(*va.Spec.Source.PersistentVolumeName)
	}
}

// run works both queues until intake ends, then returns when every worker has finished
// the operation it holds (on Ops(), P1).
func (c *controller) run(intake context.Context) {
	c.intake.Store(&intake)
	logger := klog.FromContext(intake)
	logger.Info("Starting provisioning", "driver", c.driver, "workers", c.opts.workerThreads)
	synced := []cache.InformerSynced{c.records.informer.HasSynced}
	if c.snapshots != nil {
		synced = append(synced, c.snapshots.informer.HasSynced)
	}
	if !cache.WaitForCacheSync(intake.Done(), synced...) {
		c.claimQueue.ShutDown()
		c.volumeQueue.ShutDown()
		c.sourceQueue.ShutDown()
		c.closer.queue.ShutDown()
		return
	}
	var wg sync.WaitGroup
	n := int(c.opts.workerThreads)
	wg.Go(func() { lifecycle.RunWorkers(intake, c.claimQueue, n, c.syncClaim) })
	wg.Go(func() { lifecycle.RunWorkers(intake, c.volumeQueue, n, c.syncVolume) })
	wg.Go(func() {
		lifecycle.RunWorkers(intake, c.sourceQueue, int(c.opts.cloningProtectionThreads), c.syncSourceProtection)
	})
	wg.Go(func() { lifecycle.RunWorkers(intake, c.closer.queue, 1, c.syncClose) })
	wg.Go(func() { c.sweepSnapshots(intake, c.opts.snapshotOrphanSweepInterval) })
	wg.Wait()
	logger.Info("Provisioning stopped")
}

// claimByUID returns the claim from the cache, nil when it is gone.
func (c *controller) claimByUID(uid string) *v1.PersistentVolumeClaim {
	objs, err := c.claims.ByIndex(claimUIDIndex, uid)
	if err != nil || len(objs) == 0 {
		return nil
	}
	claim, _ := objs[0].(*v1.PersistentVolumeClaim)
	if claim == nil {
		return nil
	}
	// The newer of the cached copy and this process's last write of the claim; none when
	// that write let the API server delete it (the informer may not show it yet).
	newer, ok, err := c.ownClaims.Get(claim.Namespace + "/" + claim.Name)
	switch {
	case err != nil:
		return claim
	case !ok:
		return nil
	case newer.UID == claim.UID:
		return newer
	}
	return claim
}

func (c *controller) pending(uid string) *plan { return c.inFlight.get(uid) }

func (c *controller) setPending(uid string, p *plan) { c.inFlight.set(uid, p) }

// intakeOr is Run's intake context, or def before Run (tests that sync without it).
func (c *controller) intakeOr(def context.Context) context.Context {
	if p := c.intake.Load(); p != nil {
		return *p
	}
	return def
}

// finish ends a plan: it is no longer pending, and its source, if it has one, may be free.
func (c *controller) finish(uid string, p *plan) {
	c.setPending(uid, nil)
	if p.source.kind != sourceNone {
		c.sourceQueue.Add(p.source.key())
	}
}

// pvExists tells whether the PersistentVolume is in the cache, or was saved by this
// process a moment ago and the cache does not show it yet.
func (c *controller) pvExists(name string) bool {
	_, ok, err := c.ownPVs.Get(name)
	return err == nil && ok
}

// startingWork is the context of the API requests that start a provisioning (its plan's
// reads, the record, taking a claim for a node): they end with intake and wait behind the
// requests that finish work (lifecycle.StartingWork, P14).
func (c *controller) startingWork(ctx context.Context) (context.Context, context.CancelFunc) {
	return lifecycle.StartingWork(ctx, c.intakeOr(context.Background()))
}

// syncClaim is what happens to one claim: a volume that may exist is finished or undone
// first; otherwise decide, plan, record, create the volume, record it as a
// PersistentVolume.
func (c *controller) syncClaim(uid string) error {
	logger := klog.Background().WithValues("claimUID", uid)
	claim := c.claimByUID(uid)
	if claim != nil {
		logger = logger.WithValues("claim", klog.KObj(claim))
	}
	ctx := klog.NewContext(c.ops, logger)
	p := c.pending(uid)
	facts := c.recordFacts(uid, claim, p)
	action, why := decideRecord(facts)
	if action != recordNone {
		logger.V(4).Info("Provisioning record", "action", action.String(), "reason", why)
	}
	switch action {
	case recordDrop:
		return c.recorded(ctx, uid, claim, p, facts.rec)
	case recordUndo:
		return c.undo(ctx, uid, claim, p, facts.rec, why)
	case recordSkip:
		return nil
	case recordUntrusted:
		// Acting on it could delete a volume that is not the claim's; keeping it blocks
		// only the deletion of this claim, which the event explains.
		logger.Info("Warning: leaving a provisioning record alone", "reason", why)
		if claim != nil && hasRecord(claim) {
			c.recorder.Eventf(claim, v1.EventTypeWarning, reasonUntrusted, "Not acting on the provisioning record: %s. Check the driver for the volume, then remove finalizer %s", why, provisioningFinalizer)
		} else if about := c.eventObject(claim, facts.rec); about != nil {
			c.recorder.Eventf(about, v1.EventTypeWarning, reasonUntrusted, "Not acting on the provisioning record: %s. Check the driver for the volume", why)
		}
		return nil
	case recordFinish:
		if p != nil {
			// Retried as it is, with the same name: the driver may still be making it.
			start := time.Now()
			err := c.provision(ctx, uid, p)
			c.metrics.provisioned(p.class.Name, dataSourceKind(p.claim), start, err)
			return err
		}
	}
	if claim == nil {
		return nil
	}
	class, err := c.classFor(claim)
	if err != nil {
		return err
	}
	if ok, why := wantsVolume(claim, class, c.names()); !ok {
		logger.V(4).Info("Not provisioning", "reason", why)
		return nil
	}
	// A claim provisioned already but not bound yet comes back on every update and
	// resync: it must not cost API reads nor report a plan's error (a VAC or secret
	// deleted since) about a volume that exists. (A bad name is the plan's to report.)
	if name, err := volumeName(c.opts.volumeNamePrefix, claim.UID, c.opts.volumeNameUUIDLength); err == nil && c.pvExists(name) {
		logger.V(4).Info("PersistentVolume exists already", "pv", name)
		return nil
	}
	if d := c.slow.remaining(uid, class.UID, c.opts.retryIntervalMax, time.Now()); d > 0 {
		// Before a node deployment takes it, as upstream: the request is wrong anyway.
		logger.V(4).Info("CreateVolume was infeasible; retrying later", "after", d)
		c.claimQueue.AddAfter(uid, d)
		return nil
	}
	if c.node != nil {
		if owned, err := c.node.owns(c.intakeOr(context.Background()), c, claim, class); err != nil || !owned {
			return err
		}
	}
	start := time.Now()
	p, err = c.plan(claim, class)
	if p == nil {
		c.metrics.provisioned(class.Name, dataSourceKind(claim), start, err)
		return c.planFailed(claim, err)
	}
	// The record is written before anything is asked of the driver (the source's
	// finalizer, CreateVolume): from then on whoever leads finds the volume, finishes it or
	// undoes it.
	if err := c.recordPlan(ctx, uid, p, facts.rec); err != nil {
		if errors.Is(err, errRecordChanged) {
			logger.V(2).Info("Claim changed while being recorded; deciding again", "err", err.Error())
			return err
		}
		if lifecycle.NotStarted(err) {
			// Intake ended first: nothing was started; the next leader provisions.
			return err
		}
		c.recorder.Event(claim, v1.EventTypeWarning, "ProvisioningFailed", err.Error())
		c.metrics.provisioned(class.Name, dataSourceKind(claim), start, err)
		return err
	}
	// The source must stay until CreateVolume is done with it (the finalizer is part
	// of the operation, on Ops(), P1). The plan is pending from before the finalizer
	// goes on: the claim may be deleted while CreateVolume runs, and the pending plan
	// (and the claim's record) is then the sign that the source is still in use.
	c.setPending(uid, p)
	if err := c.protectSource(ctx, p.source); err != nil {
		c.finish(uid, p)
		c.recorder.Event(claim, v1.EventTypeWarning, "ProvisioningFailed", err.Error())
		return err
	}
	err = c.provision(ctx, uid, p)
	c.metrics.provisioned(p.class.Name, dataSourceKind(p.claim), start, err)
	return err
}

// recordPlan makes sure the plan's record is open before its CreateVolume. A record of
// the same request (a retry, or a previous leader's) stays as it is, unless it is old
// enough for its event to expire soon (recordRefresh). A record of another request stays
// open while what it asked for is unknown: the volume it may have made is undone first
// (errRecordChanged sends the claim back to be decided again).
func (c *controller) recordPlan(ctx context.Context, uid string, p *plan, existing *claimRecord) error {
	rec, err := newRecord(c.driver, p.claim.Annotations[volumehelpers.AnnSelectedNode], p.pv.secrets.provisioner, p.req)
	if err != nil {
		return err
	}
	rec.claim = claimReference(p.claim)
	if p.source.kind != sourceNone {
		rec.Source = p.source.key()
	}
	if existing != nil && existing.sameAs(rec) && !c.recordAging(uid) {
		p.rec = existing
		return nil
	}
	if existing != nil && !c.absent.is(uid, existing.Volume) {
		if err := c.undo(ctx, uid, p.claim, nil, existing, "the claim asks for its volume differently now"); err != nil {
			return err
		}
		return fmt.Errorf("%w: the volume of the earlier request was undone", errRecordChanged)
	}
	if err := c.writeRecord(ctx, p.claim, rec); err != nil {
		return err
	}
	p.rec = rec
	return nil
}

// recordAging tells whether the claim's open record was written long enough ago to be
// written again (recordRefresh).
func (c *controller) recordAging(uid string) bool {
	open, err := c.records.open(uid)
	return err == nil && open != nil && c.records.now().Sub(open.written) > recordRefresh
}

// classFor returns the claim's StorageClass; nil, nil for a claim without one.
func (c *controller) classFor(claim *v1.PersistentVolumeClaim) (*storagev1.StorageClass, error) {
	name := storageClassName(claim)
	if name == "" {
		return nil, nil
	}
	class, err := c.classes.Get(name)
	if err != nil {
		// It may be created later: retry with backoff.
		return nil, fmt.Errorf("storageClass %q of claim %s: %w", name, klog.KObj(claim), err)
	}
	return class, nil
}

// planFailed reports a claim that cannot be provisioned yet and decides how to go on.
func (c *controller) planFailed(claim *v1.PersistentVolumeClaim, err error) error {
	if lifecycle.NotStarted(err) {
		// The plan's reads were cut short by intake's end: nothing to report.
		return err
	}
	if errors.Is(err, errExternalPopulator) {
		c.recorder.Event(claim, v1.EventTypeNormal, "Provisioning", "Assuming an external populator will provision the volume")
		return nil
	}
	c.recorder.Event(claim, v1.EventTypeWarning, "ProvisioningFailed", err.Error())
	if errors.As(err, new(rescheduleError)) {
		return c.reschedule(c.ops, claim, err)
	}
	return err
}

// provision calls CreateVolume and records the volume as a PersistentVolume, then drops the
// claim's record, all on Ops() (P1): a volume the driver created is always recorded,
// retried, or undone.
func (c *controller) provision(ctx context.Context, uid string, p *plan) error {
	logger := klog.FromContext(ctx)
	// Whatever was known about the name, this call may make it.
	c.absent.forget(uid)
	callCtx, cancel := context.WithTimeout(lifecycle.MarkMigrated(ctx, p.pv.migrated), c.opts.timeout)
	resp, err := c.csi.CreateVolume(callCtx, p.req)
	cancel()
	if lifecycle.NotStarted(err) {
		// Draining or no longer leading: nothing failed, and the record (if any) is the
		// next leader's to finish (P14).
		logger.V(2).Info("CreateVolume not started; left to the next leader", "volume", p.pvName)
		return err
	}
	if err != nil {
		outcome := classifyCreateError(err, p.mayReschedule)
		logger.Info("CreateVolume failed", "volume", p.pvName, "outcome", outcome.String(), "err", err.Error())
		if isInfeasible(err) {
			c.slow.mark(uid, p.class.UID, time.Now())
			c.recorder.Eventf(p.claim, v1.EventTypeWarning, "ProvisioningFailed", "Volume provisioning failed with infeasible error. Retries will be delayed. %v", err)
		} else {
			c.recorder.Eventf(p.claim, v1.EventTypeWarning, "ProvisioningFailed", "failed to provision volume with StorageClass %q: %v", p.class.Name, err)
		}
		if isAbsentAnswer(err, outcome) {
			// The record stays while the claim wants the volume (the retry needs it); its
			// undo, if the claim stops wanting it, needs no CSI call.
			c.absent.mark(uid, p.pvName)
		}
		switch outcome {
		case createInBackground:
			c.setPending(uid, p)
			return err
		case createReschedule:
			c.finish(uid, p)
			// As upstream: a final failure may say the class's storage is short.
			c.capacityChanged(p.class.Name, nil)
			return c.reschedule(ctx, p.claim, err)
		default:
			c.finish(uid, p)
			c.capacityChanged(p.class.Name, nil)
			return err
		}
	}
	// From here the volume exists: until it is recorded or deleted, it stays pending.
	c.setPending(uid, p)
	id := resp.GetVolume().GetVolumeId()
	// A claim deleted or rescheduled while CreateVolume ran does not get the volume: it is
	// deleted now, while its ID is known, rather than recorded for nobody.
	if act, why := decideRecord(c.recordFacts(uid, c.claimByUID(uid), p)); act == recordUndo {
		return c.discard(ctx, uid, p, id, why)
	}
	in := p.pv
	in.volume = resp.GetVolume()
	pv, err := buildPV(in)
	if err != nil {
		// The volume does not fit the claim: delete it and start over.
		c.recorder.Eventf(p.claim, v1.EventTypeWarning, "ProvisioningFailed", "failed to provision volume with StorageClass %q: %v", p.class.Name, err)
		if cleanupErr := c.deleteBackendVolume(lifecycle.MarkMigrated(ctx, p.pv.migrated), id, p.req.GetSecrets()); cleanupErr != nil {
			// Still pending: the retry creates (idempotent) and cleans up again.
			return fmt.Errorf("%w; cleanup of volume %s failed, volume is orphaned: %v", err, p.pvName, cleanupErr)
		}
		// Nothing is left in the driver: the next attempt is planned from the claim, if
		// there still is one.
		c.absent.mark(uid, p.pvName)
		c.finish(uid, p)
		return err
	}
	if err := c.savePV(ctx, pv); err != nil {
		c.recorder.Eventf(p.claim, v1.EventTypeWarning, "ProvisioningFailed", "volume %s created but its PersistentVolume could not be saved: %v", p.pvName, err)
		return err
	}
	c.capacityChanged(p.class.Name, resp.GetVolume().GetAccessibleTopology())
	logger.V(2).Info("Provisioned", "pv", pv.Name, "volumeHandle", id, "migrated", p.pv.migrated)
	// The PersistentVolume records the volume now: upstream's ProvisioningSucceeded event
	// closes the record. If it fails the plan stays pending and the retry finds the
	// PersistentVolume.
	return c.recorded(ctx, uid, c.claimByUID(uid), p, p.rec)
}

// discard deletes a volume just created for a claim that no longer wants it, then closes
// the record; a failure leaves the plan pending, and the retry undoes it.
func (c *controller) discard(ctx context.Context, uid string, p *plan, id, why string) error {
	claim := c.claimByUID(uid)
	if err := c.deleteBackendVolume(lifecycle.MarkMigrated(ctx, p.pv.migrated), id, p.req.GetSecrets()); err != nil {
		return c.undoFailed(ctx, claim, p.rec, why, fmt.Errorf("DeleteVolume %s: %w", id, err))
	}
	c.absent.mark(uid, p.pvName)
	c.capacityChanged(p.class.Name, nil)
	return c.undone(ctx, uid, claim, p, p.rec, why, fmt.Sprintf("volume %s deleted", p.pvName))
}

// deleteBackendVolume deletes a volume that has no PersistentVolume, on Ops() (P1).
func (c *controller) deleteBackendVolume(ctx context.Context, id string, secrets map[string]string) error {
	callCtx, cancel := context.WithTimeout(ctx, c.opts.timeout)
	defer cancel()
	_, err := c.csi.DeleteVolume(callCtx, &csi.DeleteVolumeRequest{VolumeId: id, Secrets: secrets})
	return err
}

// inFlight holds, by claim UID, the plan of every CreateVolume that is about to run or may
// still be running in the driver: it is retried as it is, claim or no claim, until the
// driver answers for good. It is also what keeps the plan's source protected while the
// claim may be gone (sourceUser).
type inFlight struct {
	mu    sync.Mutex
	plans map[string]*plan
}

func (f *inFlight) get(uid string) *plan {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.plans[uid]
}

// set makes p the claim's plan in flight; nil: none.
func (f *inFlight) set(uid string, p *plan) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p == nil {
		delete(f.plans, uid)
		return
	}
	if f.plans == nil {
		f.plans = map[string]*plan{}
	}
	f.plans[uid] = p
}

// using names the claim of a plan in flight made from ref, "" for none.
func (f *inFlight) using(ref sourceRef) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, p := range f.plans {
		if p.source == ref {
			return klog.KObj(p.claim).String()
		}
	}
	return ""
}
