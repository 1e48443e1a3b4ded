package e2e

import (
	"context"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// fastLease is a lease timing short enough for expiry tests: a standby that saw a renewal
// may take the Lease 6 s later; a leader that cannot renew fences itself 4 s after its last
// renewal started.
var fastLease = []string{"--leader-election-lease-duration=6s", "--leader-election-renew-deadline=4s", "--leader-election-retry-period=1s"}

const leaseDuration = 6 * time.Second

// P10: a leader killed mid-operation and restarted under the same identity (a container
// restart in the same pod) does not take its old Lease back at once: the driver may still
// run the dead process's calls. It leads only once the Lease expired, and no operation
// overlaps.
func TestCrashedLeaderRestartedUnderItsOwnNameWaitsForTheLease(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 4 * time.Second}})
	a := s.leaderBusy("replica-a", 4, fastLease...)
	before := s.lease()

	killed := a.Signal(t, syscall.SIGKILL)
	a.Wait(t, 10*time.Second)
	// Same identity, as a container restarted in its pod; its own socket, so the journal
	// tells its calls from the dead process's.
	again := s.startReplica("replica-a-restarted", append(fastLease, "--leader-election-identity=replica-a")...)
	s.WaitForCalls("the restarted replica's first call", func(c []testdriver.Call) bool { return len(callsOn(c, again)) > 0 })
	first := callsOn(s.Driver.Journal(), again)[0].Start
	t.Logf("FIGURE crash restart: the restarted leader's first call %v after SIGKILL (lease %v)", first.Sub(killed).Round(time.Millisecond), leaseDuration)
	if first.Sub(killed) < leaseDuration {
		t.Errorf("the restarted process called the driver %v after the kill, before the Lease could expire (%v)", first.Sub(killed), leaseDuration)
	}
	after := s.lease()
	if after.Spec.AcquireTime.Equal(before.Spec.AcquireTime) {
		t.Errorf("the restarted process renewed the dead process's record instead of taking the Lease anew")
	}
	s.WaitUntil("all 4 results recorded", func() bool { return countResults(s.results(), "ok") == 4 })
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", len(o), o)
	}
}

// P11, frozen past the renew deadline: a leader whose path to the API server hangs fences
// itself (no new call, every call cancelled) before the standby may take the Lease, so its
// last call starts before the standby's first; it never writes the Lease again after the
// thaw, and no operation overlaps. The test sidecar calls the driver before it records the
// result, and retries when the record times out, so a leader that kept going would call the
// driver during the freeze.
func TestLeaderCutOffFromTheAPIServerFencesBeforeTheStandbyTakesOver(t *testing.T) {
	f := runFreeze(t)
	t.Logf("FIGURE freeze: replica-a's last call started %v after the freeze, it exited after %v; replica-b's first call %v after the freeze",
		f.lastCall.Round(time.Millisecond), f.exit.Round(time.Millisecond), f.takeover.Round(time.Millisecond))
}

// BenchmarkFreeze prints, for a leader cut off from the API server (lease 6s, renew
// deadline 4s, retry 1s), the time from the freeze to its last call, to its exit (fenced)
// and to the standby's first call.
func BenchmarkFreeze(b *testing.B) {
	var sum freezeFigures
	for range b.N {
		f := runFreeze(b)
		sum.lastCall += f.lastCall
		sum.exit += f.exit
		sum.takeover += f.takeover
	}
	n := float64(b.N)
	b.ReportMetric(sum.lastCall.Seconds()/n, "last-call-s")
	b.ReportMetric(sum.exit.Seconds()/n, "fenced-exit-s")
	b.ReportMetric(sum.takeover.Seconds()/n, "standby-first-call-s")
}

// freezeFigures are times from the freeze.
type freezeFigures struct{ lastCall, exit, takeover time.Duration }

// runFreeze runs the freeze scenario and checks its promises.
func runFreeze(t testing.TB) freezeFigures {
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 300 * time.Millisecond}})
	proxy := e2e.NewFaultProxy(t, strings.TrimPrefix(s.CP.URL(), "https://"))
	a := s.startReplica("replica-a", append(fastLease, "--kubeconfig="+s.KubeconfigVia(proxy), "--timeout=1s")...)
	s.waitForHolder("replica-a")
	b := s.startReplica("replica-b", append(fastLease, "--timeout=1s")...)
	a.WaitReady(t)
	b.WaitReady(t)
	writes := s.watchLeaseWrites()

	s.createWork(40)
	s.WaitForCalls("replica-a at work", func(c []testdriver.Call) bool { return len(callsOn(c, a)) > 0 })
	proxy.Freeze()
	frozen := time.Now()
	s.WaitForCalls("replica-b's first call", func(c []testdriver.Call) bool { return len(callsOn(c, b)) > 0 })
	if code := a.Wait(t, 30*time.Second); code == 0 {
		t.Errorf("replica-a exit code 0 after it was cut off, want non-zero")
	}
	proxy.Thaw()
	thawed := time.Now()
	s.WaitUntil("all 40 results recorded", func() bool { return countResults(s.results(), "ok") == 40 })

	calls := s.Driver.Journal()
	takeover := callsOn(calls, b)[0].Start
	var lastA time.Time
	for _, c := range callsOn(calls, a) {
		lastA = maxTime(lastA, c.Start)
		if !c.CallerGone.IsZero() && c.CallerGone.After(takeover) {
			t.Errorf("replica-a's call for %s was still waited on %v after replica-b's first call", c.VolumeName, c.CallerGone.Sub(takeover))
		}
	}
	if !lastA.Before(takeover) {
		t.Errorf("replica-a started a call %v after replica-b's first call", lastA.Sub(takeover))
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", len(o), o)
	}
	for _, w := range writes.since(thawed) {
		if w.holder == "replica-a" || w.holder == "" {
			t.Errorf("the Lease was written with holder %q %v after the thaw", w.holder, w.at.Sub(thawed))
		}
	}
	if h := e2e.Holder(s.lease()); h != "replica-b" {
		t.Errorf("Lease holder %q, want replica-b", h)
	}
	return freezeFigures{lastCall: lastA.Sub(frozen), exit: a.ExitedAt.Sub(frozen), takeover: takeover.Sub(frozen)}
}

// P11, frozen shorter than the renew deadline: the leader keeps leading, nothing is fenced
// and the standby does not take over.
func TestShortAPIServerStallDoesNotFenceTheLeader(t *testing.T) {
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 300 * time.Millisecond}})
	proxy := e2e.NewFaultProxy(t, strings.TrimPrefix(s.CP.URL(), "https://"))
	a := s.startReplica("replica-a", append(fastLease, "--kubeconfig="+s.KubeconfigVia(proxy))...)
	s.waitForHolder("replica-a")
	b := s.startReplica("replica-b", fastLease...)
	a.WaitReady(t)
	b.WaitReady(t)
	s.createWork(10)
	s.WaitForCalls("replica-a at work", func(c []testdriver.Call) bool { return len(callsOn(c, a)) > 0 })

	proxy.Freeze()
	time.Sleep(1500 * time.Millisecond) // the stall itself: shorter than the 4 s renew deadline
	proxy.Thaw()
	s.WaitUntil("all 10 results recorded", func() bool { return countResults(s.results(), "ok") == 10 })

	if !a.Running() {
		t.Fatalf("replica-a exited with %d after a 1.5 s stall", a.ExitCode)
	}
	calls := s.Driver.Journal()
	if n := len(callsOn(calls, b)); n != 0 {
		t.Errorf("replica-b made %d calls; the leader never lost the Lease", n)
	}
	for _, c := range callsOn(calls, a) {
		if c.Canceled {
			t.Errorf("replica-a's call for %s was cancelled", c.VolumeName)
		}
	}
	if h := e2e.Holder(s.lease()); h != "replica-a" {
		t.Errorf("Lease holder %q, want replica-a", h)
	}
}

// A driver that dies while the leader drains may still be running what it was told: the
// Lease is kept (it expires) and the exit code is 1.
func TestDriverKilledDuringADrainKeepsTheLease(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 5 * time.Second}})
	a := s.leaderBusy("replica-a", 2)

	a.Signal(t, syscall.SIGTERM)
	s.waitDraining(a)
	a.Driver.Stop()
	if code := a.Wait(t, 30*time.Second); code != 1 {
		t.Errorf("exit code %d after the driver died during the drain, want 1", code)
	}
	if h := e2e.Holder(s.lease()); h != "replica-a" {
		t.Errorf("Lease holder %q, want replica-a (kept, left to expire)", h)
	}
}

func countResults(results map[string]string, want string) int {
	n := 0
	for _, r := range results {
		if r == want {
			n++
		}
	}
	return n
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// leaseWrite is one version of the Lease seen by the test's watch.
type leaseWrite struct {
	at     time.Time
	holder string
}

type leaseWrites struct {
	mu     sync.Mutex
	writes []leaseWrite
}

func (w *leaseWrites) since(t time.Time) []leaseWrite {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []leaseWrite
	for _, x := range w.writes {
		if x.at.After(t) {
			out = append(out, x)
		}
	}
	return out
}

// watchLeaseWrites records every write of the scenario's Lease from now until the test
// ends, across apiserver restarts (a retry watcher resumes from the last version seen).
func (s *scenario) watchLeaseWrites() *leaseWrites {
	s.T.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s.T.Cleanup(cancel)
	selector := fields.OneTermEqualSelector("metadata.name", s.leaseName).String()
	leases := s.Client.CoordinationV1().Leases(s.Namespace)
	list, err := leases.List(ctx, metav1.ListOptions{FieldSelector: selector})
	if err != nil {
		s.T.Fatal(err)
	}
	wi, err := watchtools.NewRetryWatcherWithContext(ctx, list.ResourceVersion, &cache.ListWatch{
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = selector
			return leases.Watch(ctx, o)
		},
	})
	if err != nil {
		s.T.Fatal(err)
	}
	out := &leaseWrites{}
	go func() {
		defer wi.Stop()
		for ev := range wi.ResultChan() {
			l, ok := ev.Object.(*coordinationv1.Lease)
			if !ok || ev.Type == watch.Bookmark {
				continue
			}
			out.mu.Lock()
			out.writes = append(out.writes, leaseWrite{at: time.Now(), holder: e2e.Holder(l)})
			out.mu.Unlock()
		}
	}()
	return out
}

// kube-apiserver restarted (stopped and started on the same etcd) while the leader is idle:
// renewals fail for a few seconds, less than the renew deadline, so the leader keeps
// leading and works on when the apiserver is back; the standby never takes over.
func TestAPIServerRestartWhileIdleKeepsTheLeader(t *testing.T) {
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 200 * time.Millisecond}})
	a := s.startReplica("replica-a")
	s.waitForHolder("replica-a")
	b := s.startReplica("replica-b")
	a.WaitReady(t)
	b.WaitReady(t)

	restartStart := time.Now()
	if err := s.CP.RestartAPIServer(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Logf("FIGURE apiserver restart took %v", time.Since(restartStart).Round(time.Millisecond))
	s.createWork(5)
	s.WaitUntil("all 5 results recorded", func() bool { return countResults(s.results(), "ok") == 5 })
	if !a.Running() {
		t.Fatalf("replica-a exited with %d", a.ExitCode)
	}
	if n := len(callsOn(s.Driver.Journal(), b)); n != 0 {
		t.Errorf("replica-b made %d calls, want none: the leader never lost the Lease", n)
	}
	if h := e2e.Holder(s.lease()); h != "replica-a" {
		t.Errorf("Lease holder %q, want replica-a", h)
	}
}

// kube-apiserver restarted while the leader drains: the drain still completes, every call
// ends uncancelled, the Lease is not released before the last call ended, and no work is
// lost (every result recorded, by the leader or after it by the standby).
func TestAPIServerRestartDuringADrainLosesNoWorkAndReleasesNoEarlier(t *testing.T) {
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 6 * time.Second}})
	a := s.startReplica("replica-a")
	s.waitForHolder("replica-a")
	b := s.startReplica("replica-b")
	a.WaitReady(t)
	b.WaitReady(t)
	writes := s.watchLeaseWrites()
	s.createWork(8)
	s.WaitForCalls("4 calls in flight on replica-a", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) == 4 })

	a.Signal(t, syscall.SIGTERM)
	if err := s.CP.RestartAPIServer(context.Background()); err != nil {
		t.Fatal(err)
	}
	code := a.Wait(t, 40*time.Second)
	s.WaitUntil("all 4 results recorded", func() bool { return countResults(s.results(), "ok") == 4 })

	calls := s.Driver.Journal()
	var lastEnd time.Time
	for _, c := range callsOn(calls, a) {
		lastEnd = maxTime(lastEnd, c.End)
		if c.Canceled || c.Code != "OK" {
			t.Errorf("replica-a's call for %s: code %s, cancelled %v; want OK, not cancelled", c.VolumeName, c.Code, c.Canceled)
		}
	}
	for _, w := range writes.since(time.Time{}) {
		if w.holder == "" && w.at.Before(lastEnd) {
			t.Errorf("the Lease was released %v before replica-a's last call ended", lastEnd.Sub(w.at))
		}
	}
	if first := callsOn(calls, b); len(first) > 0 && first[0].Start.Before(lastEnd) {
		t.Errorf("replica-b called the driver %v before replica-a's last call ended", lastEnd.Sub(first[0].Start))
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", len(o), o)
	}
	t.Logf("FIGURE apiserver restart during a drain: replica-a exit %d after %v", code, a.ExitedAt.Sub(lastEnd).Round(time.Millisecond))
}
