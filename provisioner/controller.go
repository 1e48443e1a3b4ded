// The wiring: newController builds the parts on the informer factory, and run works their
// queues until intake ends.

package provisioner

import (
	"context"
	"fmt"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/client-go/informers"
	storagev1informers "k8s.io/client-go/informers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/deletion"
	"github.com/csi-sidecars/csi-sidecars/provisioner/record"
	"github.com/csi-sidecars/csi-sidecars/provisioner/refgrant"
	"github.com/csi-sidecars/csi-sidecars/provisioner/sources"
)

// Upstream's queue names (sig-storage-lib-external-provisioner), the label of the
// workqueue metrics.
const (
	claimQueueName  = "claims"
	volumeQueueName = "volumes"
	// sourceQueueName is ours: upstream removes source finalizers inline.
	sourceQueueName = "provisioner-sources"
)

// newController wires the listers, handlers and queues on factory. It must run before the
// factory starts.
func newController(cfg config, factory informers.SharedInformerFactory) (*claimController, error) {
	c := &claimController{config: cfg}
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
	}, claimSourceNamespaceIndex: claimSourceNamespace}); err != nil {
		return nil, fmt.Errorf("indexing claims: %w", err)
	}
	c.claims = claims.GetIndexer()
	own, err := lifecycle.NewOwnWrites[*v1.PersistentVolumeClaim](klog.Background(), claims)
	if err != nil {
		return nil, fmt.Errorf("claim cache: %w", err)
	}
	c.ownClaims = own
	rewrites := queue(record.RewriteQueueName)
	if c.records, err = record.NewStore(record.StoreConfig{Kube: cfg.kube, Driver: cfg.driver, Source: cfg.eventSource,
		Claims: own, StartingWork: c.startingWork, NotKept: cfg.metrics.recordNotKept, Lost: rewrites.Add}); err != nil {
		return nil, err
	}
	c.closer = record.NewCloser(queue(record.CloseQueueName), c.records, cfg.ops, func() context.Context { return c.intakeOr(cfg.ops) })
	c.rewriter = record.NewRewriter(rewrites, c.records, record.RewriterConfig{Ops: cfg.ops,
		Intake:     func() context.Context { return c.intakeOr(cfg.ops) },
		Superseded: func(uid, volume string) bool { return c.closer.Pending(uid) || c.pvExists(volume) },
		Rewritten:  cfg.metrics.recordRewritten})
	if err := c.records.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: c.enqueueRecorded}); err != nil {
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
	guard := sources.Config{Names: cfg.names(), Kube: cfg.kube, Ops: cfg.ops, Timeout: cfg.opts.timeout}
	if c.sources, err = sources.New(guard, queue(sourceQueueName), c, claims, own, c.volumes, c.classes, cfg.snapshotClient); err != nil {
		return nil, err
	}
	if c.ownPVs, err = lifecycle.NewOwnCreations[*v1.PersistentVolume](klog.Background(), volumes.Informer()); err != nil {
		return nil, fmt.Errorf("PersistentVolume cache: %w", err)
	}
	var attachments storagev1informers.VolumeAttachmentInformer
	if cfg.controllerCaps[csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME] {
		attachments = factory.Storage().V1().VolumeAttachments()
	}
	deletions := deletion.Config{Names: cfg.names(), Kube: cfg.kube, Recorder: cfg.recorder, Ops: cfg.ops,
		PluginCaps: cfg.pluginCaps, ControllerCaps: cfg.controllerCaps, DeleteVolume: c.deleteBackendVolume,
		Deleted: cfg.metrics.deleted, CapacityChanged: c.capacityChanged}
	if cfg.node != nil {
		deletions.Holds = cfg.node.holds
	}
	if c.deleter, err = deletion.New(deletions, queue(volumeQueueName), c.ownPVs, volumes.Informer(), c.classes, attachments); err != nil {
		return nil, err
	}

	if cfg.grantClient != nil {
		if c.access.grants, err = refgrant.New(cfg.grantClient, lifecycle.TrimForCache, wakeOnGrant(c.claims, c.enqueueClaim)); err != nil {
			return nil, err
		}
	}
	c.planner = &planner{config: &c.config, access: c.access, classes: c.classes, volumes: c.volumes, claims: own, snapshots: cfg.snapshotClient, startingWork: c.startingWork}
	c.undoer = &undoer{config: &c.config, records: c.records, classes: c.classes, absent: &c.absent, claims: c}
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

// startInformers starts the informers that are not on the core's factory, the records',
// the snapshots' and the ReferenceGrants', until stop closes (every replica, P7).
func (c *claimController) startInformers(stop <-chan struct{}) {
	c.records.Start(stop)
	c.sources.Start(stop)
	if c.access.grants != nil {
		c.access.grants.Start(stop)
	}
}

// run works both queues until intake ends, then returns when every worker has finished
// the operation it holds (on Ops(), P1).
func (c *claimController) run(intake context.Context) {
	c.intake.Store(&intake)
	logger := klog.FromContext(intake)
	logger.Info("Starting provisioning", "driver", c.driver, "workers", c.opts.workerThreads)
	// The grants are waited for only until the API server answers: a cluster without their
	// CRD, or an RBAC without them, holds back no claim of a source of its own namespace.
	grantsAnswered := func() bool { return c.access.grants == nil || c.access.grants.Answered() }
	if !cache.WaitForCacheSync(intake.Done(), c.records.HasSynced, c.sources.HasSynced, grantsAnswered) {
		c.claimQueue.ShutDown()
		c.rewriter.Queue().ShutDown()
		c.deleter.Queue().ShutDown()
		c.sources.Queue().ShutDown()
		c.closer.Queue().ShutDown()
		return
	}
	var wg sync.WaitGroup
	n := int(c.opts.workerThreads)
	wg.Go(func() { lifecycle.RunWorkers(intake, c.claimQueue, n, c.syncClaim) })
	wg.Go(func() { lifecycle.RunWorkers(intake, c.deleter.Queue(), n, c.deleter.Sync) })
	wg.Go(func() {
		lifecycle.RunWorkers(intake, c.sources.Queue(), int(c.opts.cloningProtectionThreads), c.sources.Sync)
	})
	wg.Go(func() { lifecycle.RunWorkers(intake, c.closer.Queue(), 1, c.closer.Sync) })
	wg.Go(func() { lifecycle.RunWorkers(intake, c.rewriter.Queue(), 1, c.rewriter.Sync) })
	wg.Go(func() { c.sources.Sweep(intake, c.opts.snapshotOrphanSweepInterval) })
	wg.Wait()
	logger.Info("Provisioning stopped")
}
