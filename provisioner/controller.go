package provisioner

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/client-go/informers"
	storagev1informers "k8s.io/client-go/informers/storage/v1"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
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
func (c *config) capacityChanged(class string, topology []*csi.Topology) {
	if c.capacity != nil && class != "" {
		c.capacity.refresh(class, topology)
	}
}

// controller provisions and deletes the driver's volumes: a claim queue and a volume queue,
// fed by informer handlers that only enqueue.
type controller struct {
	config

	claims  cache.Indexer
	classes storagelisters.StorageClassLister
	volumes corelisters.PersistentVolumeLister

	claimQueue *lifecycle.Queue[string]
	// planner makes each claim's plan.
	planner *planner
	// undoer deletes the volumes that claims no longer want and closes their records.
	undoer *undoer
	// deleter deletes the driver's released PersistentVolumes, with a queue of its own.
	deleter *volumeDeleter
	// sources protects the data sources of clones and restores, with a queue of its own.
	sources *sourceGuard
	// closer writes the events that close records, off the provisioning's path.
	closer *closer
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
	c.records.claims, c.records.startingWork = own, c.startingWork
	c.closer = &closer{queue: queue(closeQueueName), records: c.records, ops: cfg.ops, intake: func() context.Context { return c.intakeOr(cfg.ops) }}
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

	c.classes = factory.Storage().V1().StorageClasses().Lister()
	volumes := factory.Core().V1().PersistentVolumes()
	c.volumes = volumes.Lister()
	if c.sources, err = newSourceGuard(&c.config, queue(sourceQueueName), c, claims, own, c.volumes, c.classes, cfg.snapshotClient); err != nil {
		return nil, err
	}
	if c.ownPVs, err = lifecycle.NewOwnCreations[*v1.PersistentVolume](klog.Background(), volumes.Informer()); err != nil {
		return nil, fmt.Errorf("PersistentVolume cache: %w", err)
	}
	var attachments storagev1informers.VolumeAttachmentInformer
	if cfg.controllerCaps[csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME] {
		attachments = factory.Storage().V1().VolumeAttachments()
	}
	if c.deleter, err = newVolumeDeleter(&c.config, queue(volumeQueueName), c.ownPVs, volumes.Informer(), c.classes, attachments); err != nil {
		return nil, err
	}

	c.planner = &planner{config: &c.config, classes: c.classes, volumes: c.volumes, claims: own, snapshots: c.sources.snapshots, startingWork: c.startingWork}
	c.undoer = &undoer{config: &c.config, records: c.records, planner: c.planner, absent: &c.absent, claims: c}
	if cfg.topology {
		if cfg.node != nil {
			// A node deployment knows its one node; it does not watch the cluster's.
			c.planner.nodes, c.planner.csiNodes = cfg.node.listers(cfg.driver)
		} else {
			c.planner.nodes = factory.Core().V1().Nodes().Lister()
			c.planner.csiNodes = factory.Storage().V1().CSINodes().Lister()
		}
	}
	return c, nil
}

// requeue decides the claim again (the undo's way back).
func (c *controller) requeue(uid string) { c.claimQueue.Add(uid) }

// startInformers starts the informers that are not on the core's factory, the records'
// and the snapshots', until stop closes (every replica, P7).
func (c *controller) startInformers(stop <-chan struct{}) {
	c.records.start(stop)
	c.sources.start(stop)
}

// run works both queues until intake ends, then returns when every worker has finished
// the operation it holds (on Ops(), P1).
func (c *controller) run(intake context.Context) {
	c.intake.Store(&intake)
	logger := klog.FromContext(intake)
	logger.Info("Starting provisioning", "driver", c.driver, "workers", c.opts.workerThreads)
	synced := []cache.InformerSynced{c.records.informer.HasSynced}
	if c.sources.snapshots != nil {
		synced = append(synced, c.sources.snapshots.informer.HasSynced)
	}
	if !cache.WaitForCacheSync(intake.Done(), synced...) {
		c.claimQueue.ShutDown()
		c.deleter.queue.ShutDown()
		c.sources.queue.ShutDown()
		c.closer.queue.ShutDown()
		return
	}
	var wg sync.WaitGroup
	n := int(c.opts.workerThreads)
	wg.Go(func() { lifecycle.RunWorkers(intake, c.claimQueue, n, c.syncClaim) })
	wg.Go(func() { lifecycle.RunWorkers(intake, c.deleter.queue, n, c.deleter.sync) })
	wg.Go(func() {
		lifecycle.RunWorkers(intake, c.sources.queue, int(c.opts.cloningProtectionThreads), c.sources.sync)
	})
	wg.Go(func() { lifecycle.RunWorkers(intake, c.closer.queue, 1, c.closer.sync) })
	wg.Go(func() { c.sources.sweep(intake, c.opts.snapshotOrphanSweepInterval) })
	wg.Wait()
	logger.Info("Provisioning stopped")
}

// intakeOr is Run's intake context, or def before Run (tests that sync without it).
func (c *controller) intakeOr(def context.Context) context.Context {
	if p := c.intake.Load(); p != nil {
		return *p
	}
	return def
}

// startingWork is the context of the API requests that start a provisioning (its plan's
// reads, the record, taking a claim for a node): they end with intake and wait behind the
// requests that finish work (lifecycle.StartingWork, P14).
func (c *controller) startingWork(ctx context.Context) (context.Context, context.CancelFunc) {
	return lifecycle.StartingWork(ctx, c.intakeOr(context.Background()))
}
