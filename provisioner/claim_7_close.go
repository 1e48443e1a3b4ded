// Stage 7 of a claim: the record closed once the PersistentVolume is saved, by
// ProvisioningSucceeded, written off the provisioning's path (closer).

package provisioner

import (
	"context"
	"fmt"
	"sync"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
)

// recorded ends a record whose volume a PersistentVolume records, with upstream's
// ProvisioningSucceeded event, and the plan, if any, is done.
//
// The event is written later, by the record closer (the closer below): a PersistentVolume
// supersedes the record, so nothing waits for it, and a provisioning costs two writes on
// its way to a bound claim (the record and the PersistentVolume), not three (P14).
func (c *controller) recorded(ctx context.Context, uid string, claim *v1.PersistentVolumeClaim, p *plan, rec *claimRecord) error {
	if err := c.dropLegacyRecord(ctx, claim); err != nil {
		klog.FromContext(ctx).V(2).Info("Cannot remove the provisioning record from the claim, retrying", "err", err.Error())
		return err
	}
	c.absent.forget(uid)
	if p != nil {
		c.finish(uid, p)
	}
	c.closer.later(uid, c.claimRef(claim, rec), rec.Volume)
	return nil
}

// closeRecord ends the claim's record once the volume is known (recorded by a
// PersistentVolume, or undone) with the event that says so, on ctx (Ops()). A record of an
// earlier version leaves the claim too (one update of the freshest copy this process
// knows; a conflict goes back to the queue, never to a fresh read, P14).
func (c *controller) closeRecord(ctx context.Context, uid string, claim *v1.PersistentVolumeClaim, rec *claimRecord, eventType, reason, message string) error {
	if err := c.dropLegacyRecord(ctx, claim); err != nil {
		return err
	}
	return c.records.close(ctx, uid, c.claimRef(claim, rec), eventType, reason, message)
}

// dropLegacyRecord removes a record of an earlier version from the claim, if it has one.
func (c *controller) dropLegacyRecord(ctx context.Context, claim *v1.PersistentVolumeClaim) error {
	if claim == nil || !hasRecord(claim) {
		return nil
	}
	update, _ := withoutRecord(claim)
	out, err := c.kube.CoreV1().PersistentVolumeClaims(claim.Namespace).Update(ctx, update, metav1.UpdateOptions{})
	switch {
	case err == nil:
		c.ownClaims.Wrote(out)
	case !apierrors.IsNotFound(err):
		return fmt.Errorf("removing the provisioning record from claim %s: %w", klog.KObj(claim), err)
	}
	return nil
}

// claimRef is the reference events about the claim use: the claim's, else (it is gone) the
// one its record's event holds.
func (c *controller) claimRef(claim *v1.PersistentVolumeClaim, rec *claimRecord) v1.ObjectReference {
	if claim != nil {
		return claimReference(claim)
	}
	if rec != nil {
		return rec.claim
	}
	return v1.ObjectReference{}
}

// closeQueueName is the record closer's queue (ours: upstream has no record).
const closeQueueName = "provisioner-records"

// The record closer writes the ProvisioningSucceeded event that closes the record of a
// provisioning whose PersistentVolume is saved. Upstream writes that event through the
// event recorder, off the provisioning's path; so does this, with its own queue and one
// worker, at the lowest priority of the budget (lifecycle.Deferrable): under a full budget
// claims are bound first and the events follow, as upstream's do. Until it is written the
// record stays open and the PersistentVolume supersedes it (decideRecord: drop); what is
// left when intake ends the next leader closes.

// closing is a record to close: the claim it is about and its volume.
type closing struct {
	claim  v1.ObjectReference
	volume string
}

// closer holds the records to close: its queue, by claim UID, and what to write for each.
type closer struct {
	queue *lifecycle.Queue[string]

	mu   sync.Mutex
	todo map[string]closing
}

// later queues the closing of the claim's record.
func (q *closer) later(uid string, claim v1.ObjectReference, volume string) {
	q.mu.Lock()
	if q.todo == nil {
		q.todo = map[string]closing{}
	}
	q.todo[uid] = closing{claim: claim, volume: volume}
	q.mu.Unlock()
	q.queue.Add(uid)
}

// pending tells whether the claim's record waits for its closing event here.
func (q *closer) pending(uid string) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	_, ok := q.todo[uid]
	return ok
}

func (q *closer) next(uid string) (closing, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	todo, ok := q.todo[uid]
	return todo, ok
}

func (q *closer) done(uid string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	delete(q.todo, uid)
}

// syncClose writes the event that closes the claim's record, if it is still open.
func (c *controller) syncClose(uid string) error {
	todo, ok := c.closer.next(uid)
	if !ok {
		return nil
	}
	done := func() { c.closer.done(uid) }
	if !c.records.isOpen(uid) {
		// Closed meanwhile (an undo, or a sync that found it closed by another leader).
		done()
		return nil
	}
	ctx, cancel := lifecycle.Deferrable(klog.NewContext(c.ops, klog.Background().WithValues("claimUID", uid)), c.intakeOr(c.ops))
	defer cancel()
	err := lifecycle.IfNotStarted(ctx, c.records.close(ctx, uid, todo.claim, v1.EventTypeNormal, reasonSucceeded, fmt.Sprintf("Successfully provisioned volume %s", todo.volume)))
	switch {
	case lifecycle.NotStarted(err):
		// Intake ended: the PersistentVolume supersedes the record; the next leader closes it.
		done()
		return nil
	case err != nil:
		return err
	}
	done()
	return nil
}
