package provisioner

import (
	"fmt"
	"sync"

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
