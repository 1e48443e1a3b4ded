// Package budget is a leading sidecar's API budget (--kube-api-qps, --kube-api-burst) and
// the clients that spend it: the token bucket that serves requests by class (P14), the
// transport where a client waits for its token and is measured (rest_client_* per
// sidecar), and the event broadcaster whose writes wait as events. A Server, which never
// talks to the API server, uses none of it.
package budget

import (
	"context"
	"errors"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"
)

// A sidecar's API budget (--kube-api-qps, --kube-api-burst) is a token bucket, as client-go's
// own, with two differences that keep goodput up when the offered load is more than the
// budget (P14):
//
//   - Requests that start new work (StartingWork: a provisioning record, an attach's
//     finalizer) get a token only when no other request of the sidecar waits for one. Work
//     already in the driver is recorded first; new work waits, instead of every operation
//     taking longer and more of them timing out half-done.
//   - The event recorder's writes (Env.Events) are informational: they wait behind every
//     request that finishes work, so a burst of events never delays a result's write, and
//     ahead of requests that start it, so new work cannot starve them.
//   - Requests nothing waits for (Deferrable: an event that closes a provisioning record
//     a PersistentVolume already supersedes) get a token only when no other request waits.
//   - None of these takes a token the sidecar owes: while CSI calls are in flight, each will
//     want a write that records its result, and an event, a request that starts work or a
//     deferrable one is served only once the bucket holds a token for it and one for each of
//     those (up to the burst). So a drain waits for its calls and one round trip, not for
//     tokens new work took a moment before (P1, P14).
//   - A request waits for its token as long as its context lives. The sidecars put no
//     deadline on an API write: client-go's request timeout starts after the token, and the
//     API server bounds a request itself. A write that times out in the limiter and is
//     retried with a fresh read spends the budget twice and is a congestion collapse.
//
// The core builds one budget per hosted sidecar; that sidecar's clients (Env.Kube,
// Env.RestConfig) wait for its tokens in their transport (RESTMetrics.Client), where the
// wait is measured. A nil budget (a negative --kube-api-qps) means no client-side limit. The
// run that builds a budget stops it as it returns: its dispatcher ends, and a request
// still waiting for a token, or made later, fails.
type Budget struct {
	qps     float32
	limiter *rate.Limiter

	mu sync.Mutex
	// waiting holds the requests waiting for a token, by class: finishing (and every
	// other request) first, events second, starting third, deferrable last; each in
	// arrival order.
	waiting [4][]*budgetWaiter
	started bool
	wake    chan struct{}
	// stopped is closed by Stop.
	stopped  chan struct{}
	stopOnce sync.Once
	// owed counts the writes the sidecar will owe soon: its CSI calls in flight, each of
	// which records its result. Nil: none.
	owed func() int
}

type budgetWaiter struct {
	ready   chan struct{}
	granted bool
}

const (
	classFinishing = iota
	classEvents
	classStarting
	classDeferrable
)

// classKey marks a context with the class of its requests.
type classKey struct{}

var _ flowcontrol.RateLimiter = &Budget{}

func newBudget(qps float32, burst int) *Budget {
	return &Budget{qps: qps, limiter: rate.NewLimiter(rate.Limit(qps), burst), wake: make(chan struct{}, 1), stopped: make(chan struct{})}
}

// For is the budget of qps and burst by client-go's rules: 0 is client-go's default (5
// and 10), a negative QPS means no client-side limit (nil). owed, when not nil, counts the
// writes the sidecar will owe soon: its CSI calls in flight, each of which records its
// result; no request but one that finishes work takes the tokens they need.
func For(qps float32, burst int, owed func() int) *Budget {
	switch {
	case qps < 0:
		return nil
	case qps == 0:
		qps, burst = rest.DefaultQPS, rest.DefaultBurst
	}
	if burst <= 0 {
		burst = rest.DefaultBurst
	}
	b := newBudget(qps, burst)
	b.owed = owed
	return b
}

// StartingWork returns a context for the API writes that start new work, before the driver
// is called (a record, a finalizer put on first): it ends when intake ends, so such a write
// never stretches a drain (P14: the work is left, with what was recorded, to the next
// leader), and its requests wait for a token behind every request that finishes work.
// Cancel it when the write is done.
func StartingWork(ctx, intake context.Context) (context.Context, context.CancelFunc) {
	return withClass(ctx, intake, classStarting)
}

// Deferrable returns a context for API writes that nothing waits for and that the next
// leader would redo (an event closing a record that a PersistentVolume already
// supersedes): they get a token only when no other request of the sidecar waits, and end
// with intake (EndedWithIntake) so that they never stretch a drain. Cancel it when done.
func Deferrable(ctx, intake context.Context) (context.Context, context.CancelFunc) {
	return withClass(ctx, intake, classDeferrable)
}

func withClass(ctx, intake context.Context, class int) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(context.WithValue(ctx, classKey{}, class))
	stop := context.AfterFunc(intake, func() { cancel(errIntakeEnded) })
	return ctx, func() { stop(); cancel(context.Canceled) }
}

// errBudgetStopped is what a request gets from a budget whose run has ended.
var errBudgetStopped = errors.New("the API budget is stopped: its run has ended")

// errIntakeEnded is why a StartingWork context ends with intake.
var errIntakeEnded = errors.New("intake ended: the work is left to the next leader")

// EndedWithIntake tells whether ctx, a StartingWork or Deferrable context, ended because
// intake did: the write that would have started the work did not happen, or its answer was
// not waited for (lifecycle.IfNotStarted).
func EndedWithIntake(ctx context.Context) bool {
	return errors.Is(context.Cause(ctx), errIntakeEnded)
}

// eventWrites marks ctx as the context of the event recorder's writes.
func eventWrites(ctx context.Context) context.Context {
	return context.WithValue(ctx, classKey{}, classEvents)
}

func classOf(ctx context.Context) int {
	class, _ := ctx.Value(classKey{}).(int)
	return class
}

// Wait blocks until the request may be sent or ctx ends.
func (b *Budget) Wait(ctx context.Context) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	w := &budgetWaiter{ready: make(chan struct{})}
	class := classOf(ctx)
	b.mu.Lock()
	select {
	case <-b.stopped:
		b.mu.Unlock()
		return errBudgetStopped
	default:
	}
	b.waiting[class] = append(b.waiting[class], w)
	if !b.started {
		b.started = true
		go b.dispatch()
	}
	b.mu.Unlock()
	b.poke()
	var err error
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
		err = context.Cause(ctx)
	case <-b.stopped:
		err = errBudgetStopped
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if w.granted {
		return nil
	}
	q := b.waiting[class]
	for i, x := range q {
		if x == w {
			b.waiting[class] = append(q[:i:i], q[i+1:]...)
			break
		}
	}
	return err
}

func (b *Budget) poke() {
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// dispatch hands out tokens, one at a time, each to the first waiter of the most urgent
// class at the moment the token is there. It runs until Stop.
func (b *Budget) dispatch() {
	for {
		if !b.anyWaiting() {
			select {
			case <-b.wake:
			case <-b.stopped:
				return
			}
			continue
		}
		if short := b.owedShortfall(); short > 0 {
			// The next waiter would take a token a recording write needs: wait until the
			// bucket holds enough, or until someone else comes (a recording write is served
			// at once).
			if !b.sleep(time.Duration(short/float64(b.qps)*float64(time.Second)), b.wake) {
				return
			}
			continue
		}
		r := b.limiter.Reserve()
		if d := r.Delay(); d > 0 && !b.sleep(d, nil) {
			r.Cancel()
			return
		}
		b.mu.Lock()
		w := b.next()
		if w == nil {
			// Everyone gave up meanwhile: the token goes back.
			r.Cancel()
		} else {
			w.granted = true
			close(w.ready)
		}
		b.mu.Unlock()
	}
}

// sleep waits d, or until wake has a value; false when the budget is stopped first.
func (b *Budget) sleep(d time.Duration, wake <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-wake:
	case <-b.stopped:
		return false
	}
	return true
}

// owedShortfall is how many tokens the bucket lacks before the next waiter may be served:
// none for a request that finishes work; for any other, a token
// for it and one for each write owed (up to the burst), less what the bucket holds.
func (b *Budget) owedShortfall() float64 {
	if b.owed == nil {
		return 0
	}
	b.mu.Lock()
	finishing := len(b.waiting[classFinishing])
	b.mu.Unlock()
	if finishing > 0 {
		return 0
	}
	owed := b.owed()
	if owed <= 0 {
		return 0
	}
	need := float64(min(1+owed, b.limiter.Burst()))
	return max(0, need-b.limiter.Tokens())
}

func (b *Budget) anyWaiting() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, q := range b.waiting {
		n += len(q)
	}
	return n > 0
}

// next pops the waiter to serve; b.mu held.
func (b *Budget) next() *budgetWaiter {
	for class := range b.waiting {
		if q := b.waiting[class]; len(q) > 0 {
			b.waiting[class] = q[1:]
			return q[0]
		}
	}
	return nil
}

// TryAccept takes a token if one is there and nobody waits for it.
func (b *Budget) TryAccept() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.waiting[classFinishing])+len(b.waiting[classEvents])+len(b.waiting[classStarting]) > 0 {
		return false
	}
	return b.limiter.Allow()
}

// Accept blocks until a token is there.
func (b *Budget) Accept() { _ = b.Wait(context.Background()) }

// QPS is the budget's rate.
func (b *Budget) QPS() float32 { return b.qps }

// Stop ends the dispatcher and fails every request that waits for a token, or comes later.
func (b *Budget) Stop() {
	b.stopOnce.Do(func() { close(b.stopped) })
}
