// Package lease is a leading sidecar's Lease: the watch that tells a standby the moment
// the Lease is free and a leader the moment it is not its own (Watch), the
// compare-and-swap write that takes it (Acquire), and the lock of one term through which
// client-go renews it, timed so that a leader fences itself before a standby may take over,
// and which alone empties the holder (TermLock). A Server, which never leads, uses none of
// it.
package lease

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	coordinationclient "k8s.io/client-go/kubernetes/typed/coordination/v1"
	"k8s.io/client-go/tools/cache"
	rl "k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle/cached"
)

var (
	errLockClosed   = errors.New("lease writes stopped: this term is over")
	errNotThisTerm  = errors.New("refusing to write a Lease record this term did not take")
	errLeaseHeld    = errors.New("lease is held by another replica")
	errNotOursAgain = errors.New("the Lease holds a record this term did not write")
)

// TermLock is the Lease lock of one term: from the write that takes the Lease to the end of
// leading. client-go's LeaderElector renews through it (with ReleaseOnCancel off, so
// client-go never empties the holder), and it keeps the rules client-go does not:
//
//   - It writes only this term's record: the holder is this identity and the acquire time
//     the one this term wrote. A record with the same identity written by an earlier
//     process (a container restarted in the same pod) is not this term's (P10).
//   - It times renewals: Expired() closes renewDeadline after the start of the last write
//     that succeeded. A standby that saw that write may take the Lease one lease duration
//     after it saw it, which is later (P11).
//   - It writes the record once per minInterval (the retry period): client-go calls it
//     every Timing.Tick so that a failed renewal is retried within half a second,
//     not a retry period later; the calls in between succeed without a write, as do client-go's
//     acquire and first renewal right after the write that took the Lease. Expiry still
//     counts from the last real write.
//   - Each renewal attempt has its own short deadline (attemptTimeout): client-go's write
//     and, when it fails, the read and write of its slow path share it, so a request
//     hanging on a dead connection costs one attemptTimeout of the renew deadline, and
//     the next attempt runs on fresh connections (newConns). An API server that returns
//     inside the renew deadline finds the leader still leading (P11).
//   - After Close() it writes nothing, so a fenced leader never touches the Lease again.
//   - Release() is the one place that empties the holder (P2).
//
// Its mutex is never held across a call to the API server, so fencing never waits on a
// stuck renewal.
type TermLock struct {
	rl.Interface
	renewDeadline  time.Duration
	minInterval    time.Duration
	attemptTimeout time.Duration
	// newConns drops the Lease client's connections after an attempt that timed out: a
	// connection to an API server that went away can hang every later request on it.
	newConns func()

	mu       sync.Mutex
	acquired time.Time // AcquireTime of this term's record, at the API's microsecond precision
	renewed  time.Time // start of the last successful write of this term's record
	closed   bool
	timer    *time.Timer
	expired  chan struct{}
	expire   sync.Once
	// attemptEnds is the deadline of the current renewal attempt; slowPath is set while
	// client-go reads and writes again after its first write of the attempt failed.
	attemptEnds time.Time
	slowPath    bool
}

// Timing is how a term renews: writes once per retry period while they succeed, retried
// every tick after a failure, each attempt bounded by Attempt, and the leader fenced
// RenewDeadline after the start of its last successful write.
type Timing struct {
	RenewDeadline, RetryPeriod, Tick, Attempt time.Duration
}

// TimingOf derives the renewal timing from the leader-election flags
// (--leader-election-renew-deadline and --leader-election-retry-period). A failed renewal
// is retried every tenth of the retry period, at most every 500ms and at least every
// 50ms, so that an API server that returns inside the renew deadline is seen in time
// without polling a healthy one more often than upstream (one write per retry period).
// An attempt may take a fifth of the renew deadline, at least 1s (never more than half
// the deadline): a slow answer on a loaded server still counts, a hung one leaves time
// for several more.
func TimingOf(renewDeadline, retryPeriod time.Duration) Timing {
	tick := min(max(retryPeriod/10, 50*time.Millisecond), 500*time.Millisecond)
	attempt := min(max(renewDeadline/5, time.Second), renewDeadline/2)
	return Timing{RenewDeadline: renewDeadline, RetryPeriod: retryPeriod, Tick: tick, Attempt: attempt}
}

// NewTermLock is the lock of a term on lock, renewed by t. newConns, when not nil, drops
// the connections of lock's client after an attempt that timed out.
func NewTermLock(lock rl.Interface, t Timing, newConns func()) *TermLock {
	if newConns == nil {
		newConns = func() {}
	}
	return &TermLock{Interface: lock, renewDeadline: t.RenewDeadline, minInterval: t.RetryPeriod,
		attemptTimeout: t.Attempt, newConns: newConns, expired: make(chan struct{})}
}

// attempt bounds one call to the API server. A write starts a new renewal attempt, unless
// it is the slow path's write after a failed one, which shares that attempt's deadline as
// the slow path's read does (even when it has passed: the read then fails at once).
func (l *TermLock) attempt(ctx context.Context, read bool) (context.Context, context.CancelFunc, bool) {
	now := time.Now()
	l.mu.Lock()
	shared := l.slowPath && (read || now.Before(l.attemptEnds))
	if !shared {
		l.attemptEnds = now.Add(l.attemptTimeout)
		l.slowPath = false
	}
	if !read {
		l.slowPath = false
	}
	end := l.attemptEnds
	l.mu.Unlock()
	ctx, cancel := context.WithDeadline(ctx, end)
	return ctx, cancel, shared
}

// attemptFailed records a failed call: a first write that failed opens client-go's slow
// path; a call that ran out of time drops the connections it may have hung on.
func (l *TermLock) attemptFailed(ctx context.Context, err error, firstWrite bool) {
	l.mu.Lock()
	l.slowPath = firstWrite
	l.mu.Unlock()
	if errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil {
		l.newConns()
	}
}

// Get reads the Lease within the current renewal attempt.
func (l *TermLock) Get(ctx context.Context) (*rl.LeaderElectionRecord, []byte, error) {
	actx, cancel, _ := l.attempt(ctx, true)
	defer cancel()
	rec, raw, err := l.Interface.Get(actx)
	if err != nil {
		l.attemptFailed(actx, err, false)
	}
	return rec, raw, err
}

// begin fixes the acquire time of the record this term is about to write.
func (l *TermLock) begin(acquired time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.acquired = acquired
}

// AcquiredAt is the acquire time of this term's record.
func (l *TermLock) AcquiredAt() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.acquired
}

// ours tells whether rec is this term's record.
func (l *TermLock) ours(rec *rl.LeaderElectionRecord) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return isTermRecord(rec, l.Identity(), l.acquired)
}

func isTermRecord(rec *rl.LeaderElectionRecord, identity string, acquired time.Time) bool {
	return rec != nil && !acquired.IsZero() && rec.HolderIdentity == identity && rec.AcquireTime.Time.Equal(acquired)
}

func (l *TermLock) Create(ctx context.Context, r rl.LeaderElectionRecord) error {
	return l.write(ctx, r, l.Interface.Create)
}

func (l *TermLock) Update(ctx context.Context, r rl.LeaderElectionRecord) error {
	return l.write(ctx, r, l.Interface.Update)
}

func (l *TermLock) write(ctx context.Context, r rl.LeaderElectionRecord, do func(context.Context, rl.LeaderElectionRecord) error) error {
	start := time.Now()
	l.mu.Lock()
	closed, ours := l.closed, isTermRecord(&r, l.Identity(), l.acquired)
	recent := !l.renewed.IsZero() && start.Sub(l.renewed) < l.minInterval
	l.mu.Unlock()
	switch {
	case closed:
		return errLockClosed
	case !ours:
		return errNotThisTerm
	case recent:
		// The same record was written a moment ago: nothing to add.
		return nil
	}
	actx, cancel, shared := l.attempt(ctx, false)
	defer cancel()
	if err := do(actx, r); err != nil {
		l.attemptFailed(actx, err, !shared)
		return err
	}
	l.renewedAt(start)
	return nil
}

// renewedAt records a successful write that started at start and moves the fence deadline.
func (l *TermLock) renewedAt(start time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || !start.After(l.renewed) {
		return
	}
	l.renewed = start
	wait := time.Until(start.Add(l.renewDeadline))
	if l.timer == nil {
		l.timer = time.AfterFunc(wait, l.checkExpiry)
		return
	}
	l.timer.Reset(wait)
}

func (l *TermLock) checkExpiry() {
	l.mu.Lock()
	left := time.Until(l.renewed.Add(l.renewDeadline))
	if left > 0 && !l.closed {
		l.timer.Reset(left)
		l.mu.Unlock()
		return
	}
	l.mu.Unlock()
	l.expire.Do(func() { close(l.expired) })
}

// Expired is closed once renewDeadline has passed since the start of the last successful
// write without a newer one: the leader must fence itself now (P11).
func (l *TermLock) Expired() <-chan struct{} { return l.expired }

// Close stops every later write; the Lease is left as it is.
func (l *TermLock) Close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	if l.timer != nil {
		l.timer.Stop()
	}
}

// Release empties the holder of this term's record, so a standby takes over at once. It is
// the only write of an empty holder in the core, and it runs only when nothing this term
// started can still run in the driver (P2). It refuses to touch a record this term did not
// write (client-go's own release would empty another holder's record after a conflict).
func (l *TermLock) Release(ctx context.Context) error {
	l.Close()
	for {
		// Not l.Get: the release has its own deadline, not a renewal attempt's.
		rec, _, err := l.Interface.Get(ctx)
		if err != nil {
			return fmt.Errorf("reading the Lease: %w", err)
		}
		if !l.ours(rec) {
			return errNotOursAgain
		}
		now := metav1.NewTime(time.Now())
		err = l.Interface.Update(ctx, rl.LeaderElectionRecord{
			LeaderTransitions:    rec.LeaderTransitions,
			LeaseDurationSeconds: 1,
			AcquireTime:          now,
			RenewTime:            now,
		})
		if !apierrors.IsConflict(err) {
			return err
		}
		// A renewal landed after it was cancelled; read again.
	}
}

// Watch keeps this replica's view of one Lease from a watch, timed by the local clock
// as client-go does (a holder's renewTime is another machine's clock). A standby uses it to
// try the Lease the moment it is released or expires (P7); a leader uses it to notice at
// once that the record is no longer its own (P6).
type Watch struct {
	identity string

	mu         sync.Mutex
	raw        []byte
	record     *rl.LeaderElectionRecord // nil while the Lease does not exist
	observedAt time.Time
	acquired   time.Time // acquire time of this process's current term; zero before any
	leading    bool
	changed    chan struct{}
	takenOver  chan struct{}
	tookOver   bool

	// What Start runs, for Stop; set by Start, read by Stop once Start returned.
	cancel  context.CancelFunc
	factory informers.SharedInformerFactory
	polls   sync.WaitGroup
}

// NewWatch is the watch of a replica whose leader-election identity is identity.
func NewWatch(identity string) *Watch {
	return &Watch{identity: identity, changed: make(chan struct{}, 1), takenOver: make(chan struct{})}
}

// Start runs an informer on the one Lease until stop (or the end of run) and returns once
// it has synced, or when synced ends first. A draining leader keeps watching, so a takeover during the
// drain still fences it at once. Where RBAC allows no list and watch on Leases (older
// upstream roles), it polls the Lease every retry period instead, as client-go does, with
// one warning: a released Lease is then taken up to a retry period later.
//
// client has no request timeout (the watch is long); its plain requests, the access review
// and the polls, are bounded by the retry period here: a poll that has not answered by the
// next one is no use.
func (w *Watch) Start(run, synced context.Context, client kubernetes.Interface, namespace, name string, retryPeriod time.Duration) error {
	run, w.cancel = context.WithCancel(run)
	reviewCtx, cancel := context.WithTimeout(synced, retryPeriod)
	mayWatch := mayListAndWatch(reviewCtx, client, namespace)
	cancel()
	if !mayWatch {
		klog.FromContext(run).Info("Warning: RBAC does not allow list and watch on Leases here; polling the Lease every --leader-election-retry-period instead", "lease", namespace+"/"+name, "retryPeriod", retryPeriod)
		leases := client.CoordinationV1().Leases(namespace)
		poll := func(ctx context.Context) {
			ctx, cancel := context.WithTimeout(ctx, retryPeriod)
			defer cancel()
			w.pollOnce(ctx, leases, name)
		}
		poll(synced)
		w.polls.Go(func() { wait.UntilWithContext(run, poll, retryPeriod) })
		return synced.Err()
	}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithNamespace(namespace),
		informers.WithTransform(cached.Trim),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
		}))
	inf := factory.Coordination().V1().Leases().Informer()
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { w.observeLease(obj) },
		UpdateFunc: func(_, obj any) { w.observeLease(obj) },
		DeleteFunc: func(any) { w.observe(nil, nil, time.Now()) },
	})
	if err != nil {
		return err
	}
	w.factory = factory
	factory.Start(run.Done())
	if !cache.WaitForCacheSync(synced.Done(), inf.HasSynced) {
		return synced.Err()
	}
	return nil
}

// Stop ends what Start started and waits for it: the run that watches the Lease calls it
// as it ends, so that a process embedding the core keeps no goroutine of it.
func (w *Watch) Stop() {
	if w.cancel == nil {
		return // never started
	}
	w.cancel()
	if w.factory != nil {
		w.factory.Shutdown()
	}
	w.polls.Wait()
}

// mayListAndWatch asks the API server whether this client may list and watch Leases in
// namespace. When it cannot tell, it assumes so: the informer then reports what fails.
func mayListAndWatch(ctx context.Context, client kubernetes.Interface, namespace string) bool {
	for _, verb := range []string{"list", "watch"} {
		review, err := client.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authorizationv1.SelfSubjectAccessReview{
			Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &authorizationv1.ResourceAttributes{
				Namespace: namespace, Verb: verb, Group: coordinationv1.GroupName, Resource: "leases",
			}},
		}, metav1.CreateOptions{})
		if err == nil && !review.Status.Allowed {
			return false
		}
	}
	return true
}

// pollOnce reads the Lease and records what it saw.
func (w *Watch) pollOnce(ctx context.Context, leases coordinationclient.LeaseInterface, name string) {
	lease, err := leases.Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		w.observe(nil, nil, time.Now())
	case err != nil:
		klog.FromContext(ctx).V(4).Info("Cannot read the Lease", "lease", name, "err", err.Error())
	default:
		w.observeLease(lease)
	}
}

func (w *Watch) observeLease(obj any) {
	lease, ok := obj.(*coordinationv1.Lease)
	if !ok {
		return
	}
	rec := rl.LeaseSpecToLeaderElectionRecord(&lease.Spec)
	raw, err := json.Marshal(*rec)
	if err != nil {
		return
	}
	w.observe(rec, raw, time.Now())
}

// observe records a version of the Lease seen at now (from the watch or a Get). While
// leading, any record but this term's own means the Lease is lost.
func (w *Watch) observe(rec *rl.LeaderElectionRecord, raw []byte, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if rec != nil && bytes.Equal(raw, w.raw) {
		return
	}
	w.record, w.raw, w.observedAt = rec, raw, now
	if w.leading && !isTermRecord(rec, w.identity, w.acquired) && !w.tookOver {
		w.tookOver = true
		close(w.takenOver)
	}
	select {
	case w.changed <- struct{}{}:
	default:
	}
}

// untilFree tells how long, by this replica's observation, until the Lease may be taken:
// zero when it is absent, released, this term's own or expired. A record naming this
// identity that this process did not write is another holder's: the process that wrote it
// may still be running calls in the driver (P10).
func (w *Watch) untilFree(now time.Time) time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.record == nil || w.record.HolderIdentity == "" || isTermRecord(w.record, w.identity, w.acquired) {
		return 0
	}
	expiry := w.observedAt.Add(time.Duration(w.record.LeaseDurationSeconds) * time.Second)
	return max(expiry.Sub(now), 0)
}

// Lead marks the start (acquired set) or the end (zero) of leading on this term's record.
func (w *Watch) Lead(acquired time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.acquired = acquired
	w.leading = !acquired.IsZero()
}

// TakenOver is closed once, while leading, the watch saw a record other than this term's:
// the Lease is lost (P6).
func (w *Watch) TakenOver() <-chan struct{} { return w.takenOver }

// Acquire waits until the Lease is free by the watch's account and takes it with a
// compare-and-swap write through lock. It returns false when ctx ends first, having given
// back a Lease that this term's write took meanwhile. Once it returns true this term holds
// the Lease and client-go's LeaderElector, started next, renews it at once.
//
// The write that takes the Lease is not cut off by ctx (a stop), only by its attempt's own
// deadline: cut off after the API server took it, it would leave the Lease held by a
// replica that stopped, and the next standby would wait for it to expire.
func Acquire(ctx context.Context, lock *TermLock, w *Watch, leaseDuration, retryPeriod time.Duration) bool {
	logger := klog.FromContext(ctx)
	for {
		wait := w.untilFree(time.Now())
		if wait == 0 {
			err := tryAcquire(context.WithoutCancel(ctx), lock, w, leaseDuration)
			if ctx.Err() != nil {
				giveBack(ctx, lock)
				return false
			}
			if err == nil {
				return true
			}
			logger.V(4).Info("Lease not acquired", "lock", lock.Describe(), "reason", err.Error())
			// Lost a race or the API server failed; the watch wakes us on the next change.
			wait = retryPeriod
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return false
		case <-w.changed:
		case <-timer.C:
		}
		timer.Stop()
	}
}

// giveBack empties the holder of the record this term wrote, if the Lease holds it: a stop
// came while the write that took it was under way. A term that wrote nothing, or whose
// record is not the Lease's, writes nothing.
func giveBack(ctx context.Context, lock *TermLock) {
	if lock.AcquiredAt().IsZero() {
		lock.Close()
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), lock.attemptTimeout)
	defer cancel()
	if err := lock.Release(rctx); err != nil && !errors.Is(err, errNotOursAgain) {
		klog.FromContext(ctx).Info("Could not give back the Lease taken while stopping; it expires on its own", "lock", lock.Describe(), "err", err)
	}
}

// tryAcquire reads the Lease and, when it is free, writes a new record of this identity
// into it. The write carries the read's resourceVersion, so of two standbys racing only one
// wins. Every term starts a new record (new acquire time), even over a record of the same
// identity: that one belongs to another process.
func tryAcquire(ctx context.Context, lock *TermLock, w *Watch, leaseDuration time.Duration) error {
	now := time.Now()
	// The API keeps microseconds; the term's record must compare equal once read back.
	stamp := metav1.NewTime(now.Truncate(time.Microsecond))
	rec := rl.LeaderElectionRecord{
		HolderIdentity:       lock.Identity(),
		LeaseDurationSeconds: int(leaseDuration / time.Second),
		AcquireTime:          stamp,
		RenewTime:            stamp,
	}
	old, raw, err := lock.Get(ctx)
	if apierrors.IsNotFound(err) {
		lock.begin(stamp.Time)
		return lock.Create(ctx, rec)
	}
	if err != nil {
		return err
	}
	w.observe(old, raw, now)
	if w.untilFree(now) > 0 {
		return errLeaseHeld
	}
	rec.LeaderTransitions = old.LeaderTransitions + 1
	lock.begin(stamp.Time)
	return lock.Update(ctx, rec)
}
