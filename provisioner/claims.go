// A claim's way: the informer handlers queue it by UID, and syncClaim takes it from an
// open record or a decision through its plan, record and CreateVolume to its
// PersistentVolume (the package doc gives the reading order).

package provisioner

import (
	"context"
	"errors"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/record"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

func (c *claimController) enqueueClaim(obj any) {
	// A claim with a record may be bound, deleted or another provisioner's by now: its
	// volume must still be finished or undone.
	if claim, ok := obj.(*v1.PersistentVolumeClaim); ok && (mayNeedVolume(claim, c.names()) || record.Has(claim) || c.records.IsOpen(string(claim.UID))) {
		c.claimQueue.Add(string(claim.UID))
	}
}

// enqueueRecorded queues the claim of a record event whose record is open: whoever leads
// finishes or undoes it, whether the claim is still there or not.
func (c *claimController) enqueueRecorded(obj any) {
	if ev, ok := obj.(*v1.Event); ok {
		for _, uid := range c.records.ClaimKeys(ev) {
			if c.records.IsOpen(uid) {
				c.claimQueue.Add(uid)
			}
		}
	}
}

// forgetClaim drops what this process remembers about a claim that is gone, and queues it
// if its record is open: its volume is undone.
func (c *claimController) forgetClaim(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	if claim, ok := obj.(*v1.PersistentVolumeClaim); ok {
		if c.records.IsOpen(string(claim.UID)) {
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

// syncClaim is what happens to one claim: a volume that may exist is finished or undone
// first; otherwise decide, plan, record, create the volume, record it as a
// PersistentVolume.
func (c *claimController) syncClaim(uid string) error {
	logger := klog.Background().WithValues("claimUID", uid)
	claim := c.claimByUID(uid)
	if claim != nil {
		logger = logger.WithValues("claim", klog.KObj(claim))
	}
	ctx := klog.NewContext(c.ops, logger)
	// A volume that may exist already, by an open record or a plan in flight, is
	// finished, dropped or undone (decide.go, undo.go) before anything new.
	p := c.inFlight.get(uid)
	facts := c.recordFacts(uid, claim, p)
	action, why := decideRecord(facts)
	if action != recordNone {
		logger.V(4).Info("Provisioning record", "action", action.String(), "reason", why)
	}
	switch action {
	case recordDrop:
		return c.recorded(ctx, uid, claim, p, facts.rec)
	case recordUndo:
		return c.undoer.undo(ctx, uid, claim, p, facts.rec, why)
	case recordSkip:
		return nil
	case recordUntrusted:
		// Acting on it could delete a volume that is not the claim's; keeping it blocks
		// only the deletion of this claim, which the event explains.
		logger.Info("Warning: leaving a provisioning record alone", "reason", why)
		if claim != nil && record.Has(claim) {
			c.recorder.Eventf(claim, v1.EventTypeWarning, reasonUntrusted, "Not acting on the provisioning record: %s. Check the driver for the volume, then remove finalizer %s", why, record.ProvisioningFinalizer)
		} else if about := eventObject(claim, facts.rec); about != nil {
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
	// Does the claim want a volume of this driver now?
	class, err := classOf(c.classes, claim)
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
	if name, err := request.VolumeName(c.opts.volumeNamePrefix, claim.UID, c.opts.volumeNameUUIDLength); err == nil && c.pvExists(name) {
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
	// The plan (plan.go).
	start := time.Now()
	p, err = c.planner.plan(claim, class)
	if p == nil {
		c.metrics.provisioned(class.Name, dataSourceKind(claim), start, err)
		return c.planFailed(claim, err)
	}
	// The record (package record) is written before anything is asked of the
	// driver (the source's finalizer, CreateVolume): from then on whoever leads finds the
	// volume, finishes it or undoes it.
	if err := c.recordPlan(ctx, uid, p, facts.rec); err != nil {
		if errors.Is(err, record.ErrChanged) {
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
	c.inFlight.set(uid, p)
	if err := c.sources.Protect(ctx, p.source); err != nil {
		c.finish(uid, p)
		c.recorder.Event(claim, v1.EventTypeWarning, "ProvisioningFailed", err.Error())
		return err
	}
	// CreateVolume, the PersistentVolume, the record's closing (create.go, save.go,
	// record.Closer).
	err = c.provision(ctx, uid, p)
	c.metrics.provisioned(p.class.Name, dataSourceKind(p.claim), start, err)
	return err
}

// planFailed reports a claim that cannot be provisioned yet and decides how to go on.
func (c *claimController) planFailed(claim *v1.PersistentVolumeClaim, err error) error {
	if lifecycle.NotStarted(err) {
		// The plan's reads were cut short by intake's end: nothing to report.
		return err
	}
	if errors.Is(err, request.ErrExternalPopulator) {
		c.recorder.Event(claim, v1.EventTypeNormal, "Provisioning", "Assuming an external populator will provision the volume")
		return nil
	}
	c.recorder.Event(claim, v1.EventTypeWarning, "ProvisioningFailed", err.Error())
	if errors.As(err, new(rescheduleError)) {
		return c.reschedule(c.ops, claim, err)
	}
	return err
}

// recordPlan makes sure the plan's record is open before its CreateVolume. A record of
// the same request (a retry, or a previous leader's) stays as it is, unless it is old
// enough for its event to expire soon (record.RefreshAfter). A record of another request stays
// open while what it asked for is unknown: the volume it may have made is undone first
// (record.ErrChanged sends the claim back to be decided again).
func (c *claimController) recordPlan(ctx context.Context, uid string, p *plan, existing *record.Record) error {
	rec, err := record.New(c.driver, p.claim.Annotations[volumehelpers.AnnSelectedNode], p.pv.secrets.Provisioner, p.req)
	if err != nil {
		return err
	}
	rec.Claim = record.ClaimReference(p.claim)
	if p.source.Kind != request.SourceNone {
		rec.Source = p.source.Key()
	}
	switch {
	case existing != nil && existing.SameAs(rec) && !c.records.Aging(uid):
		p.rec = existing
		return nil
	case existing != nil && existing.SameAs(rec):
		// The same request, its event about to expire or gone (a lost record): written
		// again below, never undone.
	case existing != nil && !c.absent.is(uid, existing.Volume):
		if err := c.undoer.undo(ctx, uid, p.claim, nil, existing, "the claim asks for its volume differently now"); err != nil {
			return err
		}
		return fmt.Errorf("%w: the volume of the earlier request was undone", record.ErrChanged)
	}
	if err := c.records.Opening(ctx, p.claim, rec); err != nil {
		return err
	}
	p.rec = rec
	return nil
}

// owns tells whether this node provisions the claim now. For an immediate-binding claim no
// node has taken yet, it waits a random delay and then takes it by selecting its own node;
// the claim's update brings it back here as owned.
//
// The wait ends with intake (a stopping replica takes no new claims); the write that
// takes the claim runs on Ops().
func (n *localNode) owns(intake context.Context, c *claimController, claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass) (bool, error) {
	switch claim.Annotations[volumehelpers.AnnSelectedNode] {
	case n.name:
		return true, nil
	case "":
	default:
		return false, nil
	}
	if request.WaitsForFirstConsumer(class) || !n.immediateBinding {
		return false, nil
	}
	// The class as the plan reads it: the CSI translation of an in-tree class.
	csiClass, _, err := c.names().CSIClass(class)
	if err != nil {
		return false, err
	}
	if len(csiClass.AllowedTopologies) > 0 && c.topology {
		// Take it only if the class allows this node.
		if _, err := c.planner.requirements(claim, csiClass, n.name); err != nil {
			klog.FromContext(intake).V(4).Info("Not taking the claim: its class does not allow this node", "claim", klog.KObj(claim), "err", err.Error())
			return false, nil
		}
	}
	uid := string(claim.UID)
	select {
	case <-intake.Done():
		return false, nil
	case <-time.After(n.delay(uid)):
	}
	current := c.claimByUID(uid)
	if current == nil || current.Annotations[volumehelpers.AnnSelectedNode] != "" {
		// Gone, or another node was faster.
		n.forget(uid)
		return false, nil
	}
	// As late as possible, being a driver call: a node without room for the volume does
	// not take it, so that one with room can (upstream's becomeOwner). A check that
	// fails (a plan error, GetCapacity unanswered) does not stop it: provisioning then
	// fails the same way, with an event the user sees.
	if ok, err := c.planner.nodeHasCapacity(current, class, n.name); err != nil {
		klog.FromContext(intake).V(3).Info("Taking the claim although the capacity check failed", "claim", klog.KObj(claim), "err", err.Error())
	} else if !ok {
		klog.FromContext(intake).V(4).Info("Not taking the claim: not enough capacity on this node", "claim", klog.KObj(claim))
		// A later attempt (the claim's next update or resync) waits longer, as after a
		// lost race.
		n.failed(uid)
		return false, nil
	}
	current = current.DeepCopy()
	current.Annotations[volumehelpers.AnnSelectedNode] = n.name
	apiCtx, cancel := c.startingWork(c.ops)
	defer cancel()
	// Update, not patch: the resource version makes exactly one node win.
	written, err := c.kube.CoreV1().PersistentVolumeClaims(current.Namespace).Update(apiCtx, current, metav1.UpdateOptions{})
	if err != nil {
		n.failed(uid)
		return false, lifecycle.IfNotStarted(apiCtx, fmt.Errorf("selecting node %q for claim %s: %w", n.name, klog.KObj(claim), err))
	}
	c.ownClaims.Wrote(written)
	n.forget(uid)
	return false, nil
}
