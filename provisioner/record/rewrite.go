// The records no event keeps, written again by the leader off the provisioning's path
// (Rewriter), with their own queue.

package record

import (
	"context"
	"fmt"

	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// RewriteQueueName is the queue of the claims whose lost record the leader writes again
// (ours: upstream has no record).
const RewriteQueueName = "provisioner-record-rewrites"

// Rewriter writes again the records no event keeps (lostRecords), one worker on its queue,
// at the lowest priority of the budget (lifecycle.Deferrable): a record written again
// protects a call that may be in the driver, but must never delay the PersistentVolumes
// that end such calls; under a rate limit most records are superseded by their
// PersistentVolume before a retry gets through, and then need no event.
type Rewriter struct {
	queue *lifecycle.Queue[string]
	lost  *lostRecords
	cfg   RewriterConfig
}

// RewriterConfig is what the Rewriter needs from the provisioner.
type RewriterConfig struct {
	// Ops is the context of the writes (Ops(), P1); Intake returns Run's intake context,
	// or Ops before Run: the writes end with it.
	Ops    context.Context
	Intake func() context.Context
	// Superseded tells whether the claim's volume is known now (its PersistentVolume, or a
	// closing event about to be written): its record needs no event.
	Superseded func(uid, volume string) bool
	// Rewritten is told of each record written again.
	Rewritten func()
}

// NewRewriter makes the Rewriter of store's lost records, working queue, which the store
// must feed (StoreConfig.Lost).
func NewRewriter(queue *lifecycle.Queue[string], store *Store, cfg RewriterConfig) *Rewriter {
	return &Rewriter{queue: queue, lost: store.lost, cfg: cfg}
}

// Queue is the Rewriter's queue, by claim UID, for the worker that runs Sync.
func (r *Rewriter) Queue() *lifecycle.Queue[string] { return r.queue }

// Sync writes the claim's lost record again, unless its volume is known now.
func (r *Rewriter) Sync(uid string) error {
	c, ok := r.lost.get(uid)
	if !ok {
		return nil
	}
	volume := ""
	if rec, err := Decode(c.Record); err == nil {
		volume = rec.Volume
	}
	if r.cfg.Superseded(uid, volume) {
		r.lost.drop(uid)
		return nil
	}
	ctx, cancel := lifecycle.Deferrable(r.cfg.Ops, r.cfg.Intake())
	defer cancel()
	if err := lifecycle.IfNotStarted(ctx, r.lost.rewrite(ctx, uid)); err != nil {
		if lifecycle.NotStarted(err) {
			// Intake ended: the next leader, which watched the record, writes it.
			return nil
		}
		return fmt.Errorf("writing again the provisioning record of volume %s: %w", volume, err)
	}
	if r.cfg.Rewritten != nil {
		r.cfg.Rewritten()
	}
	klog.Background().V(2).Info("Provisioning record written again: no event kept it", "claimUID", uid, "volume", volume)
	return nil
}
