// The claim's way and its state (claimController): the steps from an open record or a plan to
// CreateVolume, the PersistentVolume and the record's closing, which syncClaim (claims.go)
// takes a claim through.

package provisioner

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/deletion"
	"github.com/csi-sidecars/csi-sidecars/provisioner/record"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
	"github.com/csi-sidecars/csi-sidecars/provisioner/sources"
)

// claimUIDIndex indexes claims by UID: the claim queue is keyed by UID, as upstream, so that
// a claim deleted and re-created under the same name is another piece of work.
const claimUIDIndex = "csi-sidecars-provisioner-uid"

// claimController is the claim's way: it provisions the driver's claims from its claim
// queue, fed by informer handlers that only enqueue, and holds the other parts it calls
// (newController wires them).
type claimController struct {
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
	deleter *deletion.Deleter
	// sources protects the data sources of clones and restores, with a queue of its own.
	sources *sources.Guard
	// closer writes the events that close records, off the provisioning's path.
	closer *record.Closer
	// rewriter writes again the records no event keeps, off the provisioning's path.
	rewriter *record.Rewriter
	// records keeps the provisioning records (events on the claims).
	records *record.Store
	// access says which claims may use a data source of another namespace.
	access sourceAccess

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

// claimByUID returns the claim from the cache, nil when it is gone.
func (c *claimController) claimByUID(uid string) *v1.PersistentVolumeClaim {
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

// recordFacts gathers what decideRecord needs about the claim of uid (nil: gone) and the
// plan pending in this process (nil: none).
func (c *claimController) recordFacts(uid string, claim *v1.PersistentVolumeClaim, p *plan) recordFacts {
	f := recordFacts{claim: claim, uid: types.UID(uid), driver: c.driver, inTree: c.inTree, minCut: c.opts.volumeNameUUIDLength}
	if c.node != nil {
		f.node = c.node.name
	}
	if claim != nil {
		f.wantName, _ = request.VolumeName(c.opts.volumeNamePrefix, claim.UID, c.opts.volumeNameUUIDLength)
	}
	if p != nil && p.rec != nil {
		// This process wrote it: the cache may not show it yet.
		f.rec, f.fromMemory = p.rec, true
	} else if open, err := c.records.Open(uid); open != nil || err != nil {
		f.recErr = err
		if open != nil {
			f.rec = open.Record
		}
	} else {
		// A record of an earlier version, on the claim.
		f.rec, f.recErr = record.Of(claim)
	}
	if f.rec != nil {
		// A record whose closing event this process has yet to write was superseded by a
		// PersistentVolume it saved, even if that PersistentVolume is gone since (the claim
		// deleted, the volume deleted): never undo it.
		f.pvExists = c.closer.Pending(uid) || c.pvExists(f.rec.Volume)
	}
	return f
}

// provision calls CreateVolume and records the volume as a PersistentVolume, then drops the
// claim's record, all on Ops() (P1): a volume the driver created is always recorded,
// retried, or undone.
func (c *claimController) provision(ctx context.Context, uid string, p *plan) error {
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
func (c *claimController) finish(uid string, p *plan) {
	c.inFlight.set(uid, nil)
	if p.source.Kind != request.SourceNone {
		c.sources.Queue().Add(p.source.Key())
	}
}

// reschedule removes the selected node from the claim so that the scheduler picks again.
// It returns nil once done: the claim comes back when a node is selected.
//
// It updates rather than patches: upstream's RBAC grants update on persistentvolumeclaims,
// not patch. The update carries the resource version of the freshest copy this process
// knows; a conflict (the scheduler was faster, or the claim changed) goes back to the
// queue, which decides again from the cache (P14).
func (c *claimController) reschedule(ctx context.Context, claim *v1.PersistentVolumeClaim, why error) error {
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

// SourceUser names a claim of the driver whose volume is still being made from ref: an
// operation in flight, a claim carrying a provisioning record, or a claim that names it,
// may use it (its own namespace's, or one a ReferenceGrant lets it use), is not deleted
// and has no PersistentVolume yet; "" for none. The claim may be of any namespace.
func (c *claimController) SourceUser(ref request.SourceRef) string {
	if who := c.inFlight.using(ref); who != "" {
		return who
	}
	// A claim whose record is open (a crash, a deleted claim whose volume is being undone)
	// may have a volume in creation from the source, whatever else it says.
	if who, err := c.records.UsesSource(ref.Key()); err != nil || who != "" {
		if err != nil {
			return "(records unreadable: " + err.Error() + ")"
		}
		return who
	}
	objs, err := c.claims.ByIndex(claimSourceNamespaceIndex, ref.Namespace)
	if err != nil {
		// Keep the finalizer rather than guess.
		return "(claims unreadable: " + err.Error() + ")"
	}
	for _, obj := range objs {
		claim, ok := obj.(*v1.PersistentVolumeClaim)
		if !ok {
			continue
		}
		if src, err := request.ClaimSource(claim); err != nil || src != ref {
			continue
		}
		// A claim of another namespace that names the source without a grant must not
		// keep a finalizer on it: that would let any namespace block the deletion of
		// another's snapshots and claims.
		if c.access.check(claim, ref) != nil {
			continue
		}
		// The same for a record of an earlier version, on the claim.
		if rec, err := record.Of(claim); err == nil && rec != nil && rec.Driver == c.driver {
			return klog.KObj(claim).String()
		}
		if !mayNeedVolume(claim, c.names()) || claim.DeletionTimestamp != nil {
			continue
		}
		if name, err := request.VolumeName(c.opts.volumeNamePrefix, claim.UID, c.opts.volumeNameUUIDLength); err == nil && c.pvExists(name) {
			continue
		}
		return klog.KObj(claim).String()
	}
	return ""
}

// savePV creates the PersistentVolume on ctx (Ops(), P1), retrying transient API errors. A
// PersistentVolume of that name bound to the same claim is success: an earlier attempt, or
// the previous leader, saved it.
func (c *claimController) savePV(ctx context.Context, pv *v1.PersistentVolume) error {
	var lastErr error
	err := wait.ExponentialBackoffWithContext(ctx, savePVBackoff(), func(ctx context.Context) (bool, error) {
		created, err := c.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
		switch {
		case err == nil:
			c.ownPVs.Wrote(created)
			return true, nil
		case apierrors.IsAlreadyExists(err):
			existing, getErr := c.kube.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
			if getErr != nil {
				lastErr = getErr
				return false, nil
			}
			if ref := existing.Spec.ClaimRef; ref == nil || ref.UID != pv.Spec.ClaimRef.UID {
				return false, fmt.Errorf("PersistentVolume %s exists for another claim", pv.Name)
			}
			c.ownPVs.Wrote(existing)
			return true, nil
		default:
			klog.FromContext(ctx).Info("Saving PersistentVolume failed, retrying", "pv", pv.Name, "err", err.Error())
			lastErr = err
			return false, nil
		}
	})
	// When the backoff ran out (or ctx ended), the last API error says why; a final
	// answer (the name taken by another claim) is the error itself, whatever came before.
	if err != nil && wait.Interrupted(err) && lastErr != nil {
		return fmt.Errorf("saving PersistentVolume %s: %w", pv.Name, lastErr)
	}
	return err
}

// pvExists tells whether the PersistentVolume is in the cache, or was saved by this
// process a moment ago and the cache does not show it yet.
func (c *claimController) pvExists(name string) bool {
	_, ok, err := c.ownPVs.Get(name)
	return err == nil && ok
}

// recorded ends a record whose volume a PersistentVolume records, with upstream's
// ProvisioningSucceeded event, and the plan, if any, is done.
//
// The event is written later, by the record closer (the closer below): a PersistentVolume
// supersedes the record, so nothing waits for it, and a provisioning costs two writes on
// its way to a bound claim (the record and the PersistentVolume), not three (P14).
func (c *claimController) recorded(ctx context.Context, uid string, claim *v1.PersistentVolumeClaim, p *plan, rec *record.Record) error {
	if err := c.records.DropLegacy(ctx, claim); err != nil {
		klog.FromContext(ctx).V(2).Info("Cannot remove the provisioning record from the claim, retrying", "err", err.Error())
		return err
	}
	c.absent.forget(uid)
	if p != nil {
		c.finish(uid, p)
	}
	c.closer.Later(uid, record.ClaimRef(claim, rec), rec.Volume)
	return nil
}

// intakeOr is Run's intake context, or def before Run (tests that sync without it).
func (c *claimController) intakeOr(def context.Context) context.Context {
	if p := c.intake.Load(); p != nil {
		return *p
	}
	return def
}

// startingWork is the context of the API requests that start a provisioning (its plan's
// reads, the record, taking a claim for a node): they end with intake and wait behind the
// requests that finish work (lifecycle.StartingWork, P14).
func (c *claimController) startingWork(ctx context.Context) (context.Context, context.CancelFunc) {
	return lifecycle.StartingWork(ctx, c.intakeOr(context.Background()))
}

// requeue decides the claim again (the undo's way back).
func (c *claimController) requeue(uid string) { c.claimQueue.Add(uid) }
