package lease

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/leaderelection"
	rl "k8s.io/client-go/tools/leaderelection/resourcelock"
)

func newFakeLock(t *testing.T, identity string) rl.Interface {
	t.Helper()
	client := fake.NewClientset()
	lock, err := rl.New(rl.LeasesResourceLock, "ns", "lease", client.CoreV1(), client.CoordinationV1(), rl.ResourceLockConfig{Identity: identity})
	if err != nil {
		t.Fatal(err)
	}
	return lock
}

func leaseRecord(holder string, acquired time.Time) rl.LeaderElectionRecord {
	return rl.LeaderElectionRecord{HolderIdentity: holder, LeaseDurationSeconds: 15, AcquireTime: metav1.NewTime(acquired), RenewTime: metav1.NewTime(acquired)}
}

// P10: a record with this identity that an earlier process wrote (a container restarted in
// the same pod) is another holder's: the Lease is free only after a full lease duration of
// this process's own observation, or once released.
func TestOwnIdentityWrittenByAnEarlierProcessIsAnotherHolders(t *testing.T) {
	w := NewWatch("replica-a")
	seen := time.Now()
	earlier := leaseRecord("replica-a", seen.Add(-time.Hour).Truncate(time.Microsecond))
	w.observe(&earlier, []byte("earlier"), seen)
	if got := w.untilFree(seen.Add(time.Second)); got != 14*time.Second {
		t.Errorf("until free %v after a second, want 14s (lease duration from the first observation)", got)
	}
	if got := w.untilFree(seen.Add(15 * time.Second)); got != 0 {
		t.Errorf("until free %v after a lease duration, want 0", got)
	}

	released := rl.LeaderElectionRecord{LeaseDurationSeconds: 1}
	w.observe(&released, []byte("released"), seen.Add(time.Second))
	if got := w.untilFree(seen.Add(time.Second)); got != 0 {
		t.Errorf("until free %v once released, want 0", got)
	}

	ours := leaseRecord("replica-a", seen.Truncate(time.Microsecond))
	w.Lead(ours.AcquireTime.Time)
	w.observe(&ours, []byte("ours"), seen.Add(2*time.Second))
	if got := w.untilFree(seen.Add(2 * time.Second)); got != 0 {
		t.Errorf("until free %v on this term's own record, want 0", got)
	}
}

// P6, P10: while leading, any record but this term's own is a lost Lease, also one that
// names this identity.
func TestLeaderSeesARecordOfItsOwnIdentityFromAnotherProcessAsLost(t *testing.T) {
	w := NewWatch("replica-a")
	now := time.Now().Truncate(time.Microsecond)
	ours := leaseRecord("replica-a", now)
	w.Lead(now)
	renewed := ours
	renewed.RenewTime = metav1.NewTime(now.Add(time.Second))
	w.observe(&renewed, []byte("renewed"), now.Add(time.Second))
	select {
	case <-w.takenOver:
		t.Fatal("this term's own renewal counted as a takeover")
	default:
	}
	other := leaseRecord("replica-a", now.Add(time.Second))
	w.observe(&other, []byte("other"), now.Add(2*time.Second))
	select {
	case <-w.takenOver:
	default:
		t.Fatal("a record of another process with the same identity did not count as a takeover")
	}
}

// The term lock writes only this term's record, and nothing once closed.
func TestTermLockWritesOnlyItsOwnRecordAndNothingAfterClose(t *testing.T) {
	ctx := context.Background()
	lock := NewTermLock(newFakeLock(t, "replica-a"), Timing{RenewDeadline: time.Hour, Attempt: time.Minute}, nil)
	acquired := time.Now().Truncate(time.Microsecond)
	lock.begin(acquired)
	if err := lock.Create(ctx, leaseRecord("replica-a", acquired)); err != nil {
		t.Fatal(err)
	}
	for name, rec := range map[string]rl.LeaderElectionRecord{
		"another acquire time": leaseRecord("replica-a", acquired.Add(time.Second)),
		"another holder":       leaseRecord("replica-b", acquired),
		"an empty holder":      {LeaseDurationSeconds: 1},
	} {
		if err := lock.Update(ctx, rec); !errors.Is(err, errNotThisTerm) {
			t.Errorf("writing %s: %v, want refused", name, err)
		}
	}
	if err := lock.Update(ctx, leaseRecord("replica-a", acquired)); err != nil {
		t.Errorf("renewing: %v", err)
	}
	lock.Close()
	if err := lock.Update(ctx, leaseRecord("replica-a", acquired)); !errors.Is(err, errLockClosed) {
		t.Errorf("renewing after close: %v, want refused", err)
	}
}

// P11: Expired closes renew-deadline after the start of the last successful write, and a
// successful renewal pushes it back.
func TestTermLockExpiresRenewDeadlineAfterTheLastRenewalStarted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		const deadline = 10 * time.Second
		lock := NewTermLock(newFakeLock(t, "replica-a"), Timing{RenewDeadline: deadline, Attempt: time.Minute}, nil)
		acquired := time.Now().Truncate(time.Microsecond)
		lock.begin(acquired)
		if err := lock.Create(ctx, leaseRecord("replica-a", acquired)); err != nil {
			t.Fatal(err)
		}
		expired := func() bool {
			synctest.Wait()
			select {
			case <-lock.Expired():
				return true
			default:
				return false
			}
		}
		// Renewals less than a deadline apart, for longer than a deadline in all.
		for i := range 3 {
			time.Sleep(deadline - time.Second)
			if expired() {
				t.Fatalf("expired %v after renewal %d, before the renew deadline", deadline-time.Second, i)
			}
			if err := lock.Update(ctx, leaseRecord("replica-a", acquired)); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(deadline - time.Nanosecond)
		if expired() {
			t.Fatalf("expired a nanosecond before the renew deadline %v after the last renewal", deadline)
		}
		time.Sleep(time.Nanosecond)
		if !expired() {
			t.Fatalf("not expired the renew deadline %v after the last renewal", deadline)
		}
	})
}

// P2: release empties the holder of this term's record, and refuses any other record (a
// standby's, or one of the same identity from another process).
func TestReleaseEmptiesOnlyThisTermsRecord(t *testing.T) {
	ctx := context.Background()
	base := newFakeLock(t, "replica-a")
	acquired := time.Now().Truncate(time.Microsecond)
	lock := NewTermLock(base, Timing{RenewDeadline: time.Hour, Attempt: time.Minute}, nil)
	lock.begin(acquired)
	if err := lock.Create(ctx, leaseRecord("replica-a", acquired)); err != nil {
		t.Fatal(err)
	}
	if err := lock.Release(ctx); err != nil {
		t.Fatalf("release: %v", err)
	}
	rec, _, err := base.Get(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if rec.HolderIdentity != "" {
		t.Errorf("holder %q after release, want empty", rec.HolderIdentity)
	}

	for name, other := range map[string]rl.LeaderElectionRecord{
		"a standby's":                leaseRecord("replica-b", acquired),
		"another process's, same id": leaseRecord("replica-a", acquired.Add(time.Second)),
	} {
		if err := base.Update(ctx, other); err != nil {
			t.Fatal(err)
		}
		if err := lock.Release(ctx); !errors.Is(err, errNotOursAgain) {
			t.Errorf("releasing %s record: %v, want refused", name, err)
		}
		rec, _, _ := base.Get(ctx)
		if rec.HolderIdentity != other.HolderIdentity {
			t.Errorf("releasing %s record changed the holder to %q", name, rec.HolderIdentity)
		}
	}
}

// A takeover is one write: client-go's acquire and first renewal, right after the write that
// took the Lease, write nothing, nor does any renewal within minInterval; the renewal at
// minInterval writes.
func TestTermLockWritesTheRecordOncePerMinInterval(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		client := fake.NewClientset()
		base, err := rl.New(rl.LeasesResourceLock, "ns", "lease", client.CoreV1(), client.CoordinationV1(), rl.ResourceLockConfig{Identity: "replica-a"})
		if err != nil {
			t.Fatal(err)
		}
		const interval = 5 * time.Second
		lock := NewTermLock(base, Timing{RenewDeadline: time.Hour, RetryPeriod: interval, Attempt: time.Minute}, nil)
		acquired := time.Now().Truncate(time.Microsecond)
		lock.begin(acquired)
		writes := func() int {
			n := 0
			for _, a := range client.Actions() {
				if a.GetVerb() == "create" || a.GetVerb() == "update" {
					n++
				}
			}
			return n
		}
		renew := func() {
			t.Helper()
			if _, _, err := lock.Get(ctx); err != nil {
				t.Fatal(err)
			}
			if err := lock.Update(ctx, leaseRecord("replica-a", acquired)); err != nil {
				t.Fatalf("renewing: %v", err)
			}
		}
		if err := lock.Create(ctx, leaseRecord("replica-a", acquired)); err != nil {
			t.Fatal(err)
		}
		renew()
		renew()
		time.Sleep(interval - time.Nanosecond)
		renew()
		if n := writes(); n != 1 {
			t.Errorf("%d writes for a takeover and three renewals within %v, want 1", n, interval)
		}
		time.Sleep(time.Nanosecond)
		renew()
		if n := writes(); n != 2 {
			t.Errorf("%d writes after the interval, want 2", n)
		}
	})
}

// hungLock answers every call, after delay, with its context's deadline passed, as a
// request hanging on a dead connection would, and records each call's deadline.
type hungLock struct {
	rl.Interface
	hung      bool
	delay     time.Duration
	calls     []string
	deadlines []time.Time
}

func (h *hungLock) call(ctx context.Context, verb string) error {
	d, _ := ctx.Deadline()
	h.calls = append(h.calls, verb)
	h.deadlines = append(h.deadlines, d)
	if h.hung {
		time.Sleep(h.delay)
		return fmt.Errorf("%s: %w", verb, context.DeadlineExceeded)
	}
	return nil
}

func (h *hungLock) Update(ctx context.Context, r rl.LeaderElectionRecord) error {
	return h.call(ctx, "update")
}

func (h *hungLock) Get(ctx context.Context) (*rl.LeaderElectionRecord, []byte, error) {
	return nil, nil, h.call(ctx, "get")
}

// P11: a renewal attempt is client-go's write and, when it fails, its slow path's read and
// write; the three share one short deadline, so a hung connection costs one attempt of the
// renew deadline, and the connections are dropped so that the next attempt dials anew.
// The next attempt gets a deadline of its own, and a success moves the fence deadline.
func TestEachRenewalAttemptHasItsOwnShortDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		const attempt = 2 * time.Second
		// Each failure takes a while: the slow path's read comes later than the write.
		h := &hungLock{Interface: newFakeLock(t, "replica-a"), hung: true, delay: 300 * time.Millisecond}
		dropped := 0
		lock := NewTermLock(h, Timing{RenewDeadline: time.Hour, Attempt: attempt}, func() { dropped++ })
		acquired := time.Now().Truncate(time.Microsecond)
		lock.begin(acquired)
		rec := leaseRecord("replica-a", acquired)
		// Two attempts as client-go makes them, a tick apart: fast-path write, then the
		// slow path.
		var starts []time.Time
		for range 2 {
			starts = append(starts, time.Now())
			if err := lock.Update(ctx, rec); err == nil {
				t.Fatal("a hung write succeeded")
			}
			if _, _, err := lock.Get(ctx); err == nil {
				t.Fatal("a hung read succeeded")
			}
			time.Sleep(500 * time.Millisecond)
		}
		if want := []string{"update", "get", "update", "get"}; fmt.Sprint(h.calls) != fmt.Sprint(want) {
			t.Fatalf("calls %v, want %v", h.calls, want)
		}
		for i, start := range starts {
			want := start.Add(attempt)
			if got := h.deadlines[2*i : 2*i+2]; !got[0].Equal(want) || !got[1].Equal(want) {
				t.Errorf("attempt %d: the write's and the slow path's read's deadlines %v, want both %v (the attempt's)", i, got, want)
			}
		}
		if dropped != 4 {
			t.Errorf("connections dropped %d times after 4 timed-out calls, want 4", dropped)
		}
		h.hung = false
		before := time.Now()
		if err := lock.Update(ctx, rec); err != nil {
			t.Fatalf("renewing once the API server answers: %v", err)
		}
		lock.mu.Lock()
		renewed := lock.renewed
		lock.mu.Unlock()
		if !renewed.Equal(before) {
			t.Errorf("a successful renewal at %v moved the fence deadline's start to %v, want it moved there", before, renewed)
		}
	})
}

// The renewal timing: a failure is retried within half a second at upstream's defaults,
// each attempt bounded well inside the renew deadline; client-go accepts the tick.
func TestRenewalTimingRetriesOftenWithinTheDeadline(t *testing.T) {
	for _, c := range []struct {
		lease, renew, retry time.Duration
		tick, attempt       time.Duration
	}{
		{15 * time.Second, 10 * time.Second, 5 * time.Second, 500 * time.Millisecond, 2 * time.Second},
		{3 * time.Second, 2 * time.Second, 500 * time.Millisecond, 50 * time.Millisecond, time.Second},
		{6 * time.Second, 4 * time.Second, time.Second, 100 * time.Millisecond, time.Second},
		{137 * time.Second, 107 * time.Second, 26 * time.Second, 500 * time.Millisecond, 21400 * time.Millisecond},
	} {
		got := TimingOf(c.renew, c.retry)
		if got.Tick != c.tick || got.Attempt != c.attempt || got.RetryPeriod != c.retry || got.RenewDeadline != c.renew {
			t.Errorf("%v/%v/%v: %+v, want tick %v and attempt %v", c.lease, c.renew, c.retry, got, c.tick, c.attempt)
		}
		if float64(c.renew) <= leaderelection.JitterFactor*float64(got.Tick) {
			t.Errorf("%v/%v/%v: client-go refuses a tick of %v", c.lease, c.renew, c.retry, got.Tick)
		}
	}
}

// Once stopped, the Lease watch leaves no goroutine behind, though the context it was
// started on lives on: the informer where RBAC allows list and watch, the poll where not.
func TestStoppedLeaseWatchLeavesNoGoroutine(t *testing.T) {
	for _, watch := range []bool{true, false} {
		t.Run(fmt.Sprintf("watch=%v", watch), func(t *testing.T) {
			defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
			client := fake.NewClientset()
			client.PrependReactor("create", "selfsubjectaccessreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
				review := a.(k8stesting.CreateAction).GetObject().(*authorizationv1.SelfSubjectAccessReview).DeepCopy()
				review.Status.Allowed = watch
				return true, review, nil
			})
			w := NewWatch("me")
			if err := w.Start(context.Background(), context.Background(), client, "ns", "lease", time.Second); err != nil {
				t.Fatal(err)
			}
			w.Stop()
		})
	}
}

// slowWriteLock lets the test stop the acquirer while its write is at the API server: the
// write lands, and its caller hears of its context's end, as a client whose request was
// cancelled after the server took it.
type slowWriteLock struct {
	rl.Interface
	writing chan struct{} // closed when the write has reached the "server"
	stopped chan struct{} // closed by the test once the acquirer was stopped
}

func (l *slowWriteLock) Create(ctx context.Context, r rl.LeaderElectionRecord) error {
	close(l.writing)
	<-l.stopped
	if err := l.Interface.Create(context.Background(), r); err != nil {
		return err
	}
	return ctx.Err()
}

// P4, P7: a standby stopped while its write that takes the Lease is under way exits
// without leaving the Lease held: the write ends on its own deadline, not the stop's, and
// the record it wrote is released, so the next standby takes over at once rather than at
// its expiry.
func TestStandbyStoppedDuringItsAcquireLeavesTheLeaseFree(t *testing.T) {
	base := newFakeLock(t, "replica-a")
	slow := &slowWriteLock{Interface: base, writing: make(chan struct{}), stopped: make(chan struct{})}
	lock := NewTermLock(slow, Timing{RenewDeadline: time.Hour, RetryPeriod: time.Minute, Attempt: time.Minute}, nil)
	ctx, stop := context.WithCancel(context.Background())
	acquired := make(chan bool)
	go func() { acquired <- Acquire(ctx, lock, NewWatch("replica-a"), 15*time.Second, time.Minute) }()
	<-slow.writing
	stop()
	close(slow.stopped)
	if <-acquired {
		t.Fatal("Acquire returned true after its context ended")
	}
	rec, _, err := base.Get(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if rec.HolderIdentity != "" {
		t.Errorf("holder %q after the stopped standby returned, want empty (released)", rec.HolderIdentity)
	}
}
