package attacher

import (
	"context"
	"slices"
	"sync"

	storagev1 "k8s.io/api/storage/v1"

	"github.com/csi-sidecars/csi-sidecars/attacher/finalizer"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Attach and detach work have a queue and workers each (upstream's issue 761: a burst of
// slow or failing detaches held every worker of upstream's one queue, and attaches waited
// behind the whole burst). What stays shared is the bound --worker-threads puts on syncs
// running at once, handed out in arrival order (slots); and one VolumeAttachment is only
// ever with one kind of worker at a time (vaGuard), so the driver never sees a publish and
// an unpublish of one volume and node overlap.

// kind is the work a VolumeAttachment needs, and the queue and workers that do it.
type kind int

const (
	// attachKind publishes: a VolumeAttachment that is not being deleted (a no-op once it
	// is attached, unless the reconciler forces it).
	attachKind kind = iota
	// detachKind unpublishes: a VolumeAttachment being deleted (a no-op once our
	// finalizer is gone, unless forced).
	detachKind
)

func (k kind) String() string {
	if k == detachKind {
		return "detach"
	}
	return "attach"
}

// kindOf is the kind of work va needs. The trivial handler has no detach work (no
// finalizer, no CSI call), so it has only the attach queue.
func (c *Controller) kindOf(va *storagev1.VolumeAttachment) kind {
	if va.DeletionTimestamp != nil && !c.trivial {
		return detachKind
	}
	return attachKind
}

func (c *Controller) queue(k kind) *lifecycle.Queue[string] {
	if k == detachKind {
		return c.detachQueue
	}
	return c.attachQueue
}

// enqueue puts va on the queue of the work it needs now. A VolumeAttachment whose state
// changes kind is put on the other queue by the event of that change.
func (c *Controller) enqueue(va *storagev1.VolumeAttachment) {
	c.queue(c.kindOf(va)).Add(va.Name)
}

// needsWork tells whether a sync of va would do anything: a VolumeAttachment not attached
// yet and not being deleted, one being deleted that still has our finalizer, or one the
// reconciler forced. These mirror the checks by which sync does nothing (the syncer's
// attach, detach and trivial); every other VolumeAttachment is settled.
func (c *Controller) needsWork(va *storagev1.VolumeAttachment) bool {
	if c.forced.has(va.Name) {
		return true
	}
	if c.kindOf(va) == detachKind {
		return finalizer.Has(va.Finalizers, finalizer.Name(c.driver))
	}
	return !va.Status.Attached
}

// processVA is what a worker of kind k does with a key it took from its queue.
func (c *Controller) processVA(intake context.Context, k kind, name string) error {
	if !c.guard.begin(name, k) {
		// A worker of the other kind syncs it right now; that worker hands it back to a
		// queue when it ends (below), from the state it leaves behind.
		return nil
	}
	handOver := false
	defer func() {
		if turnedAway := c.guard.end(name); turnedAway || handOver {
			c.reroute(intake, name, k)
		}
	}()
	va, err := c.cachedVA(name)
	if va == nil || err != nil {
		return c.gone(name, err)
	}
	if c.kindOf(va) != k {
		// Queued for the state before: the change to this one queued it on the other
		// queue already; reroute only makes sure.
		handOver = true
		return nil
	}
	// A settled VolumeAttachment takes no slot: at a takeover or a resync thousands of them
	// would otherwise wait in line with the work that calls the driver.
	if !c.forced.has(name) && !c.needsWork(va) {
		return nil
	}
	if !c.slots.acquire(intake) {
		return nil // intake ended while it waited: not started (P1)
	}
	defer c.slots.release()
	// Read again: waiting for a slot can take as long as a CSI call.
	if va, err = c.cachedVA(name); va == nil || err != nil {
		return c.gone(name, err)
	}
	if c.kindOf(va) != k {
		handOver = true
		return nil
	}
	return c.sync(va)
}

// reroute puts name on the other kind's queue when its cached state needs that work: after
// a worker of the other kind was turned away by the guard, or found it on the wrong queue.
// A state that needs from's work is on from's queue already (its change queued it there),
// and adding it here again would skip the backoff of a failed sync.
func (c *Controller) reroute(intake context.Context, name string, from kind) {
	if intake.Err() != nil {
		return // the queues are shut down; the next leader queues it from its cache
	}
	va, err := c.cachedVA(name)
	if va == nil || err != nil {
		return
	}
	if k := c.kindOf(va); k != from && c.needsWork(va) {
		c.queue(k).Add(name)
	}
}

// vaGuard keeps each VolumeAttachment with one kind of worker at a time. Each queue keeps
// a key with one of its own workers at a time (client-go's workqueue); the guard does it
// across the two queues. A worker of the other kind that takes the key meanwhile is turned
// away, not blocked: it is free for other work at once, and the worker holding the key
// hands it over when it ends. The cache only moves forward, so the state read then is at
// least as new as the one that queued the turned-away key.
type vaGuard struct {
	mu     sync.Mutex
	active map[string]kind
	// turnedAway names keys a worker of the other kind took while they were active.
	turnedAway map[string]bool
}

func newVAGuard() *vaGuard {
	return &vaGuard{active: map[string]kind{}, turnedAway: map[string]bool{}}
}

// begin claims name for a worker of kind k: false when a worker of the other kind has it.
func (g *vaGuard) begin(name string, k kind) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if held, ok := g.active[name]; ok && held != k {
		g.turnedAway[name] = true
		return false
	}
	g.active[name] = k
	return true
}

// end releases name and tells whether a worker of the other kind was turned away from it.
func (g *vaGuard) end(name string) (turnedAway bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.active, name)
	turnedAway = g.turnedAway[name]
	delete(g.turnedAway, name)
	return turnedAway
}

// slots bounds the syncs that run at once, attaches and detaches together, to
// --worker-threads, as upstream's one pool of that many workers did, so a driver sized for
// upstream's concurrency never sees more. A freed slot goes to the worker that has waited
// longest, whatever its kind: during a burst of one kind, work of the other kind waits for
// the first running sync to end, not for the burst (with upstream's one queue it waited
// for every item queued before it).
type slots struct {
	mu      sync.Mutex
	free    int
	waiting []chan struct{} // in arrival order
}

func newSlots(n int) *slots { return &slots{free: n} }

// acquire takes a slot, waiting in line for one. It returns false, holding nothing, once
// ctx has ended, even when a slot was free: work must not start after intake ended (P1).
func (s *slots) acquire(ctx context.Context) bool {
	if ctx.Err() != nil {
		return false
	}
	s.mu.Lock()
	if s.free > 0 && len(s.waiting) == 0 {
		s.free--
		s.mu.Unlock()
		return true
	}
	granted := make(chan struct{})
	s.waiting = append(s.waiting, granted)
	s.mu.Unlock()
	select {
	case <-granted:
		if ctx.Err() == nil {
			return true
		}
		s.release()
		return false
	case <-ctx.Done():
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if i := slices.Index(s.waiting, granted); i >= 0 {
		s.waiting = slices.Delete(s.waiting, i, i+1)
		return false
	}
	// The slot was granted as ctx ended: pass it on.
	s.releaseLocked()
	return false
}

// release returns a slot, to the longest waiting worker if there is one.
func (s *slots) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.releaseLocked()
}

func (s *slots) releaseLocked() {
	if len(s.waiting) > 0 {
		close(s.waiting[0])
		s.waiting = slices.Delete(s.waiting, 0, 1)
		return
	}
	s.free++
}
