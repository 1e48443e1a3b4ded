package resizer

import (
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// attempts remembers, per PVC key, how the last driver call (ControllerExpandVolume or
// ControllerModifyVolume) failed, for the decisions the PVC's status cannot carry: whether
// the driver may still be working on it, and when an infeasible request may be tried again;
// and a ControllerExpandVolume that succeeded while its recording failed, which the retry
// records without calling the driver again. It is held in memory like upstream's: a new
// leader starts without it (and calls once more what it cannot know ended).
type attempts struct {
	// retryMax is how long an infeasible request waits before it is tried again unchanged.
	retryMax time.Duration

	mu   sync.Mutex
	last map[string]attempt
	// expanded holds, per PVC key, the ControllerExpandVolume of this process that succeeded
	// and whose recording (the PV's capacity, the PVC's status) has not succeeded yet.
	expanded map[string]expansionDone
}

// expansionDone is a controller expansion that succeeded: of which PV, to which size, and
// what the driver answered.
type expansionDone struct {
	pv            types.UID
	size          int64 // asked for
	reached       int64
	nodeExpansion bool
}

// attempt is how a PVC's last driver call failed.
type attempt struct {
	// final: the call certainly ended in the driver (isFinal); otherwise it may still run.
	final bool
	// infeasibleAt is when the driver refused the request itself; zero otherwise.
	infeasibleAt time.Time
}

func newAttempts(retryMax time.Duration) *attempts {
	return &attempts{retryMax: retryMax, last: map[string]attempt{}, expanded: map[string]expansionDone{}}
}

// failed records a failed call of key.
func (a *attempts) failed(key string, final, infeasible bool) {
	at := attempt{final: final}
	if infeasible {
		at.infeasibleAt = time.Now()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.last[key] = at
	delete(a.expanded, key)
}

// forget drops what is known of key: its call succeeded, or the PVC is gone.
func (a *attempts) forget(key string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.last, key)
	delete(a.expanded, key)
}

// succeeded records that key's ControllerExpandVolume succeeded, until recorded says that
// what it did is written: a sync that must retry the writes finds it in expandedTo and does
// not call the driver again.
func (a *attempts) succeeded(key string, done expansionDone) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.last, key)
	a.expanded[key] = done
}

// expandedTo is key's expansion of pv to size that succeeded in this process and is not
// recorded yet; false when there is none, or it was of another PV or size.
func (a *attempts) expandedTo(key string, pv types.UID, size int64) (expansionDone, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	done, ok := a.expanded[key]
	return done, ok && done.pv == pv && done.size == size
}

// recorded says that key's expansion is written: the next one calls the driver again.
func (a *attempts) recorded(key string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.expanded, key)
}

// finalError tells whether key's last call failed and certainly ended in the driver.
func (a *attempts) finalError(key string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	at, ok := a.last[key]
	return ok && at.final
}

// inDoubt tells whether the driver may still be carrying out key's last call: it failed
// without a final answer, or this process has no record of it at all. The second matters
// for an operation the PVC's status says is in progress: a new leader (or this process
// after a restart) does not know how the call that put it there ended, and the previous
// process may have ended in the middle of it.
func (a *attempts) inDoubt(key string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	at, ok := a.last[key]
	return !ok || !at.final
}

// begin records that nothing of key is in doubt as a new call starts: one made when the
// PVC's status shows no call in flight, or whose last call ended with a final answer. The
// call's outcome replaces it; a call that fails before it reaches the driver (its secret
// cannot be read) leaves it so.
func (a *attempts) begin(key string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.last[key] = attempt{final: true}
}

// infeasibleWait is how long an unchanged request of key must still wait after the driver
// refused it as infeasible; zero when it may be tried now.
func (a *attempts) infeasibleWait(key string) time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	at, ok := a.last[key]
	if !ok || at.infeasibleAt.IsZero() {
		return 0
	}
	return max(0, a.retryMax-time.Since(at.infeasibleAt))
}
