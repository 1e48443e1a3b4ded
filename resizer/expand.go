package resizer

import (
	"context"
	"fmt"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// expansionConfig is what the expansion controller is built from.
type expansionConfig struct {
	controllerConfig
	expander    expander
	handleInUse bool
	annotateFs  bool
}

// expansionController grows the volumes of PVCs that ask for more storage.
type expansionController struct {
	writer
	expander   expander
	annotateFs bool

	queue *lifecycle.Queue[string]
	// inUse is nil without --handle-volume-inuse-error.
	inUse *inUseTracker
	// attempts says whether the last controller call ended with a final error, so the next
	// attempt may take a changed request (planExpansion), and holds back a size refused as
	// infeasible for --retry-interval-max (upstream's slow set).
	attempts *attempts
}

// newExpansionController registers the PVC and PV informers (and the Pod informer, only
// when in-use errors are handled) and their handlers; handlers only enqueue.
func newExpansionController(cfg expansionConfig) (*expansionController, error) {
	c := &expansionController{
		writer:     cfg.writer,
		expander:   cfg.expander,
		annotateFs: cfg.annotateFs,
		queue:      cfg.newQueue(),
		attempts:   newAttempts(cfg.retryMax),
	}
	// The writer reads PVCs and PVs through these informers (newWriter registered them).
	pvcInformer := cfg.informers.Core().V1().PersistentVolumeClaims()
	if _, err := pvcInformer.Informer().AddEventHandlerWithResyncPeriod(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueue,
		UpdateFunc: c.claimUpdated,
		DeleteFunc: c.claimDeleted,
	}, cfg.resync); err != nil {
		return nil, fmt.Errorf("registering the PVC handler: %w", err)
	}
	if cfg.handleInUse {
		pods := cfg.informers.Core().V1().Pods()
		c.inUse = newInUseTracker(pods.Informer().GetIndexer(), c.queue.Add)
		if _, err := pods.Informer().AddEventHandler(c.inUse.handler()); err != nil {
			return nil, fmt.Errorf("registering the Pod handler: %w", err)
		}
	}
	return c, nil
}

func (c *expansionController) enqueue(obj any) {
	if key, ok := claimKey(obj); ok {
		c.queue.Add(key)
	}
}

// claimUpdated enqueues a PVC whose request, resizer annotation, capacity or phase changed,
// or (with RecoverVolumeExpansionFailure) whose allocatedResourceStatuses took a value the
// kubelet writes, such as NodeResizeInfeasible, which the controller answers by letting the
// kubelet retry. Other updates (labels, our own status writes) cannot start a resize, so
// they must not requeue a failed PVC ahead of its backoff. A resync (same resourceVersion)
// enqueues too, to retry what is due, unless a failure's rate-limited retry is already
// pending.
func (c *expansionController) claimUpdated(oldObj, newObj any) {
	old, ok1 := oldObj.(*v1.PersistentVolumeClaim)
	pvc, ok2 := newObj.(*v1.PersistentVolumeClaim)
	if !ok1 || !ok2 {
		return
	}
	if old.ResourceVersion == pvc.ResourceVersion {
		resync(c.queue, pvc)
		return
	}
	oldReq, newReq := old.Spec.Resources.Requests[v1.ResourceStorage], pvc.Spec.Resources.Requests[v1.ResourceStorage]
	oldCap, newCap := old.Status.Capacity[v1.ResourceStorage], pvc.Status.Capacity[v1.ResourceStorage]
	if newReq.Cmp(oldReq) != 0 || newCap.Cmp(oldCap) != 0 ||
		old.Annotations[annResizer] != pvc.Annotations[annResizer] ||
		old.Status.Phase != pvc.Status.Phase ||
		kubeletResizeStatus(old, pvc) {
		c.enqueue(pvc)
	}
}

// kubeletResizeStatus tells whether the PVC's resize status changed to one this controller
// never writes: the kubelet's (NodeResizeInProgress, NodeResizeInfeasible). Upstream
// enqueues every change of it; the ones this controller writes itself are left out, so that
// the watch event of marking an attempt does not run the PVC again past a failure's
// backoff.
func kubeletResizeStatus(old, pvc *v1.PersistentVolumeClaim) bool {
	was, is := old.Status.AllocatedResourceStatuses[v1.ResourceStorage], pvc.Status.AllocatedResourceStatuses[v1.ResourceStorage]
	if was == is {
		return false
	}
	switch is {
	case "", v1.PersistentVolumeClaimControllerResizeInProgress, v1.PersistentVolumeClaimControllerResizeInfeasible, v1.PersistentVolumeClaimNodeResizePending:
		return false
	}
	return true
}

func (c *expansionController) claimDeleted(obj any) {
	key, ok := claimKey(obj)
	if !ok {
		return
	}
	c.queue.Forget(key)
	c.attempts.forget(key)
	if c.inUse != nil {
		c.inUse.forget(key)
	}
}

// run processes PVCs until intake ends (P1: the item in hand finishes on Ops()).
func (c *expansionController) run(intake context.Context, workers int) {
	c.intake = intake
	lifecycle.RunWorkers(intake, c.queue, workers, c.sync)
}

// sync brings one PVC's volume to the size it asks for, and records each step.
func (c *expansionController) sync(key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	logger := klog.FromContext(c.ops()).WithValues("pvc", key)
	pvc, ok, err := c.claim(ns, name)
	if err != nil || !ok {
		return err
	}
	if pvc.Spec.VolumeName == "" {
		return nil
	}
	pv, ok, err := c.volume(pvc.Spec.VolumeName)
	if err != nil {
		return err
	}
	if !ok {
		if !needsExpansion(pvc) {
			return nil
		}
		// The PV was created moments ago and the informer has not shown it yet (nothing
		// else would enqueue the PVC when it does): retried with backoff, as upstream.
		return fmt.Errorf("PV %s of PVC %s is not in the informer cache yet", pvc.Spec.VolumeName, key)
	}
	if !c.handles(pv, pvc) {
		return nil
	}

	// The node finished what an earlier resize left it: the pre-resize capacity is history.
	if c.annotateFs && nodeCaughtUp(pvc, pv) && pv.Annotations[annPreResizeCapacity] != "" {
		clean := pv.DeepCopy()
		delete(clean.Annotations, annPreResizeCapacity)
		if pv, err = c.patchVolume(pv, clean); err != nil {
			return err
		}
	}
	if !needsExpansion(pvc) || !boundTo(pv, pvc) {
		return nil
	}

	plan := planExpansion(pvc, pv, c.expander.controllerExpands(), c.attempts.finalError(key))
	if plan.wait {
		return nil
	}
	if plan.sameAsAllocated && pvc.Status.AllocatedResourceStatuses[v1.ResourceStorage] == v1.PersistentVolumeClaimControllerResizeInfeasible {
		if wait := c.attempts.infeasibleWait(key); wait > 0 {
			// The same size was refused moments ago: only a changed request retries sooner.
			logger.V(4).Info("Expansion was infeasible, retrying later", "after", wait)
			c.queue.AddAfter(key, wait)
			return nil
		}
	}
	if c.inUse != nil && c.inUse.blocked(pvc) {
		// An offline-only driver refused while a Pod uses the PVC, and one still does: the
		// Pod going away enqueues the PVC again. Each version of the PVC is told once.
		if c.inUse.news(pvc) {
			c.recorder.Eventf(pvc, v1.EventTypeWarning, reasonResizeFailed,
				"Unable to expand %s/%s because CSI driver %s only supports offline expansion and volume is currently in-use", pvc.Namespace, pvc.Name, c.driver)
		}
		return nil
	}
	return c.expand(logger, key, pvc, pv, plan)
}

// handles tells whether the PVC's volume is expanded by this driver: a CSI PV of the
// driver, or an in-tree PV migrated to it (CSI migration), as upstream's CanSupport
// decides. An in-tree PV is ours only once kube-controller-manager's expand controller has
// handed its PVC over by naming the driver in the storage-resizer annotation (it does so
// when migration of the plugin is on), and only if csi-translation-lib maps the PV's
// plugin to this driver. Upstream checks the annotation alone; a PV of another plugin
// would be translated and sent to the wrong driver.
func (c *expansionController) handles(pv *v1.PersistentVolume, pvc *v1.PersistentVolumeClaim) bool {
	if pv.Spec.CSI != nil {
		return pv.Spec.CSI.Driver == c.driver
	}
	return pvc.Annotations[annResizer] == c.driver && migratedTo(pv) == c.driver
}

// expand runs one expansion: mark, call, record. Every step runs on Ops() (P1). A call
// that succeeded is not made again while only its recording is retried (a write failed or
// met a conflict): the retry records what the driver answered then.
func (c *expansionController) expand(logger klog.Logger, key string, pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, plan expansion) error {
	done, expanded := c.attempts.expandedTo(key, pv.UID, plan.size.Value())
	if expanded {
		logger.V(2).Info("Volume expanded already, recording it", "pv", pv.Name, "size", plan.size.String())
	} else {
		var err error
		if pvc, err = c.startClaim(pvc, markInProgress(pvc, plan)); err != nil {
			return fmt.Errorf("marking the resize in progress: %w", err)
		}
		c.recorder.Eventf(pvc, v1.EventTypeNormal, reasonResizing, "External resizer is resizing volume %s", pv.Name)
		if c.inUse != nil {
			// A new attempt: the driver will refuse again if a Pod still uses the volume.
			c.inUse.forget(key)
		}

		ctx, cancel := c.callContext()
		ctx = klog.NewContext(ctx, logger)
		reached, nodeExpansion, callErr := c.expander.expand(ctx, pv, plan.size.Value())
		cancel()
		if callErr != nil {
			return c.recordFailure(key, pvc, pv, callErr)
		}
		done = expansionDone{pv: pv.UID, size: plan.size.Value(), reached: reached, nodeExpansion: nodeExpansion}
		c.attempts.succeeded(key, done)
	}
	reached, nodeExpansion := done.reached, done.nodeExpansion

	size := *resource.NewQuantity(reached, resource.BinarySI)
	if reached == plan.size.Value() {
		size = plan.size // keep the user's spelling ("2Gi") when the driver gave exactly that
	}
	before := pvc.Status.Capacity[v1.ResourceStorage]
	if _, err := c.patchVolume(pv, withCapacity(pv, size, before, nodeExpansion, c.annotateFs)); err != nil {
		c.recorder.Eventf(pvc, v1.EventTypeWarning, reasonResizeFailed, "error updating pv %q by resizer: %v", pv.Name, err)
		return err
	}
	if nodeExpansion {
		if _, err := c.patchClaim(pvc, markNodePending(pvc), true); err != nil {
			return c.markFailed(pvc, fmt.Errorf("mark PVC %q as node expansion required failed: %w", key, err))
		}
		c.attempts.recorded(key)
		c.recorder.Event(pvc, v1.EventTypeNormal, reasonFSResizeRequired, "Require file system resize of volume on node")
		logger.V(2).Info("Volume expanded, node expansion required", "pv", pv.Name, "size", size.String())
		return nil
	}
	if _, err := c.patchClaim(pvc, markFinished(pvc, size), true); err != nil {
		return c.markFailed(pvc, fmt.Errorf("mark PVC %q as resize finished failed: %w", key, err))
	}
	c.attempts.recorded(key)
	c.recorder.Event(pvc, v1.EventTypeNormal, reasonResizeSucceeded, "Resize volume succeeded")
	logger.V(2).Info("Volume expanded", "pv", pv.Name, "size", size.String())
	return nil
}

// markFailed reports that the volume was expanded but recording it on the PVC failed, as
// upstream: a VolumeResizeFailed event, and err for a retry.
func (c *expansionController) markFailed(pvc *v1.PersistentVolumeClaim, err error) error {
	c.recorder.Event(pvc, v1.EventTypeWarning, reasonResizeFailed, err.Error())
	return err
}

// recordFailure records a failed controller call and says whether to retry: final errors
// are written to the PVC (infeasible ones so that the user may lower the request), and an
// in-use refusal waits for the Pod to go away.
func (c *expansionController) recordFailure(key string, pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, callErr error) error {
	if lifecycle.NotStarted(callErr) {
		// Never reached the driver (draining, or no longer leading): nothing to record;
		// the next leader expands.
		return callErr
	}
	final, infeasible := lifecycle.IsFinalError(callErr), isInfeasible(callErr)
	c.attempts.failed(key, final, infeasible)
	if c.inUse != nil && isInUse(callErr) {
		c.inUse.record(key)
	}
	err := fmt.Errorf("resize volume %q by resizer %q failed: %w", pv.Name, c.driver, callErr)
	if final {
		if _, werr := c.patchClaim(pvc, markFailed(pvc, callErr, infeasible), false); werr != nil {
			err = fmt.Errorf("resizing failed in controller with %w but failed to update PVC %s with: %v", callErr, key, werr)
		}
	}
	c.recorder.Event(pvc, v1.EventTypeWarning, reasonResizeFailed, err.Error())
	switch {
	case infeasible:
		// Retried slowly, or at once when the user changes the request.
		c.queue.AddAfter(key, c.attempts.retryMax)
		return nil
	case c.inUse != nil && isInUse(callErr) && c.inUse.blocked(pvc):
		return nil
	}
	return err
}
