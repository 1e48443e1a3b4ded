// The record closed once the PersistentVolume is saved, by
// ProvisioningSucceeded, written off the provisioning's path (Closer).

package record

import (
	"context"
	"fmt"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// CloseQueueName is the record Closer's queue (ours: upstream has no record).
const CloseQueueName = "provisioner-records"

// The record Closer writes the ProvisioningSucceeded event that closes the record of a
// provisioning whose PersistentVolume is saved. Upstream writes that event through the
// event recorder, off the provisioning's path; so does this, with its own queue and one
// worker, at the lowest priority of the budget (lifecycle.Deferrable): under a full budget
// claims are bound first and the events follow, as upstream's do. Until it is written the
// record stays open and the PersistentVolume supersedes it (the claim's way drops it); what is
// left when intake ends the next leader closes.

// closing is a record to close: the claim it is about and its volume.
type closing struct {
	claim  v1.ObjectReference
	volume string
}

// Closer holds the records to close: its queue, by claim UID, and what to write for each.
type Closer struct {
	queue   *lifecycle.Queue[string]
	records *Store
	// ops is the context of the writes (Ops(), P1); intake is Run's intake context, or ops
	// before Run.
	ops    context.Context
	intake func() context.Context

	mu   sync.Mutex
	todo map[string]closing
}

// NewCloser makes the closer of the records of store, working queue. Its writes run on ops
// (Ops(), P1) and, while intake runs, its deferrable budget; intake returns Run's intake
// context, or ops before Run.
func NewCloser(queue *lifecycle.Queue[string], store *Store, ops context.Context, intake func() context.Context) *Closer {
	return &Closer{queue: queue, records: store, ops: ops, intake: intake}
}

// Queue is the closer's queue, by claim UID, for the worker that runs Sync.
func (q *Closer) Queue() *lifecycle.Queue[string] { return q.queue }

// Later queues the closing of the claim's record.
func (q *Closer) Later(uid string, claim v1.ObjectReference, volume string) {
	q.mu.Lock()
	if q.todo == nil {
		q.todo = map[string]closing{}
	}
	q.todo[uid] = closing{claim: claim, volume: volume}
	q.mu.Unlock()
	q.queue.Add(uid)
}

// Pending tells whether the claim's record waits for its closing event here.
func (q *Closer) Pending(uid string) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	_, ok := q.todo[uid]
	return ok
}

func (q *Closer) next(uid string) (closing, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	todo, ok := q.todo[uid]
	return todo, ok
}

func (q *Closer) done(uid string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	delete(q.todo, uid)
}

// Sync writes the event that closes the claim's record, if it is still open.
func (q *Closer) Sync(uid string) error {
	todo, ok := q.next(uid)
	if !ok {
		return nil
	}
	done := func() { q.done(uid) }
	if !q.records.IsOpen(uid) {
		// Closed meanwhile (an undo, or a sync that found it closed by another leader).
		done()
		return nil
	}
	ctx, cancel := lifecycle.Deferrable(klog.NewContext(q.ops, klog.Background().WithValues("claimUID", uid)), q.intake())
	defer cancel()
	err := lifecycle.IfNotStarted(ctx, q.records.close(ctx, uid, todo.claim, v1.EventTypeNormal, ReasonSucceeded, fmt.Sprintf("Successfully provisioned volume %s", todo.volume)))
	switch {
	case lifecycle.NotStarted(err):
		// Intake ended: the PersistentVolume supersedes the record; the next leader closes it.
		done()
		return nil
	case Refused(err):
		// The API server keeps no event now (rate limit, policy): upstream's event would be
		// dropped too. The PersistentVolume supersedes the record; a leader that finds its
		// opening event still open closes it then.
		klog.Background().V(2).Info("The event that closes a provisioning record was refused, leaving it to the PersistentVolume", "claimUID", uid, "err", err.Error())
		q.records.lost.drop(uid)
		done()
		return nil
	case err != nil:
		return err
	}
	done()
	return nil
}
