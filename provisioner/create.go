// CreateVolume, and what its answer means for the claim; the plans
// that may be running in the driver (inFlight).

package provisioner

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"
)

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
			c.inFlight.set(uid, p)
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
	c.inFlight.set(uid, p)
	id := resp.GetVolume().GetVolumeId()
	// A claim deleted or rescheduled while CreateVolume ran does not get the volume: it is
	// deleted now, while its ID is known, rather than recorded for nobody.
	if act, why := decideRecord(c.recordFacts(uid, c.claimByUID(uid), p)); act == recordUndo {
		return c.undoer.discard(ctx, uid, p, id, why)
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

// finish ends a plan: it is no longer pending, and its source, if it has one, may be free.
func (c *controller) finish(uid string, p *plan) {
	c.inFlight.set(uid, nil)
	if p.source.kind != sourceNone {
		c.sources.queue.Add(p.source.key())
	}
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

// createOutcome is what a failed CreateVolume means for the volume.
type createOutcome int

const (
	// createFinal: the driver is not creating the volume; retry later with backoff, or
	// give up when the claim goes away.
	createFinal createOutcome = iota
	// createInBackground: the volume may exist or be in creation. Keep calling
	// CreateVolume with the same name until the driver answers for good, even if the claim
	// is deleted meanwhile: giving up could leak the volume.
	createInBackground
	// createReschedule: final, and the scheduler should pick another node (the selected
	// node is removed from the claim).
	createReschedule
)

func (o createOutcome) String() string {
	switch o {
	case createFinal:
		return "final"
	case createInBackground:
		return "in background"
	case createReschedule:
		return "reschedule"
	}
	return "unknown"
}

// classifyCreateError tells what a CreateVolume error means, as upstream. mayReschedule
// is true when the driver has topology and a node was selected: only then can another node
// help.
func classifyCreateError(err error, mayReschedule bool) createOutcome {
	st, ok := status.FromError(err)
	if !ok {
		// Not from gRPC: the call may not even have been sent, but nothing says so for sure.
		return createInBackground
	}
	switch st.Code() {
	case codes.ResourceExhausted:
		// CSI: no room in the requested topology; not in progress.
		if mayReschedule {
			return createReschedule
		}
		return createFinal
	case codes.Canceled, codes.DeadlineExceeded, codes.Unavailable, codes.Aborted:
		// The call was cut off or the driver is still working on this name.
		return createInBackground
	}
	return createFinal
}

// reschedule removes the selected node from the claim so that the scheduler picks again.
// It returns nil once done: the claim comes back when a node is selected.
//
// It updates rather than patches: upstream's RBAC grants update on persistentvolumeclaims,
// not patch. The update carries the resource version of the freshest copy this process
// knows; a conflict (the scheduler was faster, or the claim changed) goes back to the
// queue, which decides again from the cache (P14).
func (c *controller) reschedule(ctx context.Context, claim *v1.PersistentVolumeClaim, why error) error {
	node, ok := claim.Annotations[volumehelpers.AnnSelectedNode]
	if !ok {
		return why
	}
	logger := klog.FromContext(ctx)
	if fresh := c.claimByUID(string(claim.UID)); fresh != nil {
		if fresh.Annotations[volumehelpers.AnnSelectedNode] != node {
			logger.V(4).Info("Not rescheduling: the claim's node changed meanwhile", "claim", klog.KObj(claim), "node", node)
			return nil
		}
		claim = fresh
	}
	update := claim.DeepCopy()
	delete(update.Annotations, volumehelpers.AnnSelectedNode)
	out, err := c.kube.CoreV1().PersistentVolumeClaims(claim.Namespace).Update(ctx, update, metav1.UpdateOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil
	case err != nil:
		err = fmt.Errorf("removing annotation %s from claim %s to reschedule (%v): %w", volumehelpers.AnnSelectedNode, klog.KObj(claim), why, err)
		logger.Error(err, "Cannot ask the scheduler for another node, retrying")
		return err
	}
	// The copies before the update still select the node: a sync must not plan for it
	// again from one of them.
	c.ownClaims.Wrote(out)
	logger.V(2).Info("Asked the scheduler for another node", "claim", klog.KObj(claim), "node", node, "reason", why.Error())
	return nil
}

// sourceUser names a claim of the driver whose volume is still being made from ref: an
// operation in flight, a claim carrying a provisioning record, or a claim that names it,
// is not deleted and has no PersistentVolume yet; "" for none.
func (c *controller) sourceUser(ref sourceRef) string {
	if who := c.inFlight.using(ref); who != "" {
		return who
	}
	// A claim whose record is open (a crash, a deleted claim whose volume is being undone)
	// may have a volume in creation from the source, whatever else it says.
	if who, err := c.records.usesSource(ref); err != nil || who != "" {
		if err != nil {
			return "(records unreadable: " + err.Error() + ")"
		}
		return who
	}
	objs, err := c.claims.ByIndex(cache.NamespaceIndex, ref.namespace)
	if err != nil {
		// Keep the finalizer rather than guess.
		return "(claims unreadable: " + err.Error() + ")"
	}
	for _, obj := range objs {
		claim, ok := obj.(*v1.PersistentVolumeClaim)
		if !ok {
			continue
		}
		if src, err := claimSource(claim); err != nil || src != ref {
			continue
		}
		// The same for a record of an earlier version, on the claim.
		if rec, err := recordOf(claim); err == nil && rec != nil && rec.Driver == c.driver {
			return klog.KObj(claim).String()
		}
		if !mayNeedVolume(claim, c.names()) || claim.DeletionTimestamp != nil {
			continue
		}
		if name, err := volumeName(c.opts.volumeNamePrefix, claim.UID, c.opts.volumeNameUUIDLength); err == nil && c.pvExists(name) {
			continue
		}
		return klog.KObj(claim).String()
	}
	return ""
}
