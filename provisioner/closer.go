package provisioner

import (
	"fmt"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

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

// closeLater queues the closing of the claim's record.
func (c *controller) closeLater(uid string, claim v1.ObjectReference, volume string) {
	c.mu.Lock()
	c.toClose[uid] = closing{claim: claim, volume: volume}
	c.mu.Unlock()
	c.closeQueue.Add(uid)
}

// closingPending tells whether the claim's record waits for its closing event here.
func (c *controller) closingPending(uid string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.toClose[uid]
	return ok
}

// syncClose writes the event that closes the claim's record, if it is still open.
func (c *controller) syncClose(uid string) error {
	c.mu.Lock()
	todo, ok := c.toClose[uid]
	intake := c.intake
	c.mu.Unlock()
	if !ok {
		return nil
	}
	done := func() {
		c.mu.Lock()
		delete(c.toClose, uid)
		c.mu.Unlock()
	}
	if !c.records.isOpen(uid) {
		// Closed meanwhile (an undo, or a sync that found it closed by another leader).
		done()
		return nil
	}
	if intake == nil {
		intake = c.ops
	}
	ctx, cancel := lifecycle.Deferrable(klog.NewContext(c.ops, klog.Background().WithValues("claimUID", uid)), intake)
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
