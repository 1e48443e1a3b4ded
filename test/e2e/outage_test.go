package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testsidecar"
)

// outageLease leaves a window between a retry period and the renew deadline wide enough for
// a kube-apiserver to start again in, even on a loaded machine (10 s): a leader that
// retried only once per retry period (client-go's own cadence) would try at +12 s, while
// the server is still down, and next at +24 s, past its deadline at +23 s; one that
// retries often renews once the server is back.
var outageLease = []string{"--leader-election-lease-duration=35s", "--leader-election-renew-deadline=23s", "--leader-election-retry-period=12s"}

// outageScenario is a leader with four calls in flight, a standby, and a watch of the
// Lease's writes.
type outageScenario struct {
	*scenario
	a, b   *e2e.Replica
	writes *leaseWrites
	// acquired is the leader's record before the outage.
	acquired time.Time
	// release ends the leader's calls, which the driver holds until then; nil when they
	// end by their latency.
	release func()
}

// startOutageScenario starts the scenario with calls that take latency.
func startOutageScenario(t *testing.T, latency time.Duration, lease ...string) *outageScenario {
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: latency}})
	return startOutage(s, nil, lease)
}

// startHeldOutageScenario starts the scenario with calls that the driver holds until the
// test releases them (leaderKeptLeading does once the leader has renewed after the
// outage): they are still running during the outage however long it takes.
func startHeldOutageScenario(t *testing.T, lease ...string) *outageScenario {
	s := newScenario(t, testdriver.Config{})
	return startOutage(s, s.Driver.Hold(testdriver.MethodCreateVolume), lease)
}

func startOutage(s *scenario, release func(), lease []string) *outageScenario {
	if release != nil {
		s.T.Cleanup(release)
	}
	a := s.leaderBusy("replica-a", 4, lease...)
	b := s.startReplica("replica-b", lease...)
	b.WaitReady(s.T)
	return &outageScenario{scenario: s, a: a, b: b, writes: s.watchLeaseWrites(), acquired: s.lease().Spec.AcquireTime.Time, release: release}
}

// nextRenewal waits for the leader's next write of the Lease and returns when the test saw
// it.
func (o *outageScenario) nextRenewal() time.Time {
	o.T.Helper()
	from := time.Now()
	var at time.Time
	o.WaitUntil("the leader's next renewal", func() bool {
		for _, w := range o.writes.since(from) {
			if w.holder == "replica-a" {
				at = w.at
				return true
			}
		}
		return false
	})
	return at
}

// outage stops a control-plane component at renewed+down and starts it again at
// renewed+up; it returns when the component answers again.
func (o *outageScenario) outage(renewed time.Time, down, up time.Duration, what string, stop func() error, start func(context.Context) error) time.Time {
	o.T.Helper()
	time.Sleep(time.Until(renewed.Add(down)))
	if err := stop(); err != nil {
		o.T.Fatal(err)
	}
	stopped := time.Now()
	time.Sleep(time.Until(renewed.Add(up)))
	if err := start(context.Background()); err != nil {
		o.T.Fatal(err)
	}
	returned := time.Now()
	o.T.Logf("FIGURE %s down %v, back %v after the leader's last renewal", what,
		returned.Sub(stopped).Round(time.Millisecond), returned.Sub(renewed).Round(time.Millisecond))
	return returned
}

// leaderKeptLeading checks what a user sees when an outage inside the renew deadline is
// ridden out: the leader runs, holds the Lease on the record it took, finishes every call
// uncancelled and records each result; the standby never calls the driver.
func (o *outageScenario) leaderKeptLeading(returned time.Time) {
	o.T.Helper()
	// The test's watch of the Lease may not survive the restart; the record tells.
	o.WaitUntil("a renewal after the return, or the leader's exit", func() bool {
		if !o.a.Running() {
			return true
		}
		l, err := o.Client.CoordinationV1().Leases(o.Namespace).Get(context.Background(), o.leaseName, metav1.GetOptions{})
		return err == nil && l.Spec.RenewTime != nil && e2e.Holder(l) == "replica-a" && l.Spec.RenewTime.After(returned)
	})
	if !o.a.Running() {
		o.T.Fatalf("replica-a exited with %d; want it leading through the outage", o.a.ExitCode)
	}
	if o.release != nil {
		// The calls ran through the outage; the driver ends them now.
		if n := e2e.Running(callsOn(o.Driver.Journal(), o.a)); n != 4 {
			o.T.Errorf("%d of replica-a's calls running after the outage, want the 4 held ones", n)
		}
		o.release()
	}
	o.WaitUntil("all 4 results recorded", func() bool { return countResults(o.results(), "ok") == 4 })
	// The test sidecar calls again for work whose result its cache does not show yet (a
	// relist after the restart may queue it again): those calls end too before the check.
	o.WaitForCalls("replica-a's calls ended", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, o.a)) == 0 })
	if !o.a.Running() {
		o.T.Fatalf("replica-a exited with %d; want it leading through the outage", o.a.ExitCode)
	}
	l := o.lease()
	if h := e2e.Holder(l); h != "replica-a" || !l.Spec.AcquireTime.Time.Equal(o.acquired) {
		o.T.Errorf("Lease holder %q acquired %v, want replica-a's record of %v", h, l.Spec.AcquireTime.Time, o.acquired)
	}
	calls := o.Driver.Journal()
	for _, c := range callsOn(calls, o.a) {
		if c.Canceled || c.Code != "OK" {
			o.T.Errorf("replica-a's call for %s: code %s, cancelled %v; want OK, not cancelled", c.VolumeName, c.Code, c.Canceled)
		}
	}
	if n := len(callsOn(calls, o.b)); n != 0 {
		o.T.Errorf("the standby made %d calls, want none: the leader never lost the Lease", n)
	}
	if ov := o.Driver.Overlaps(); len(ov) != 0 {
		o.T.Errorf("driver saw %d overlapping operations: %+v", len(ov), ov)
	}
}

// P11: kube-apiserver killed half a second after a renewal, while four calls run (the
// driver holds them until the leader has renewed after the outage), and started again 12 s
// later (down about 14 s in all, as a control-plane node's restart). The leader retries its
// renewal often, so the server's return inside the renew deadline finds it leading: it
// keeps its Lease and its calls, and exits nothing.
func TestLeaderKeepsItsLeaseThroughAnAPIServerRestartInsideTheRenewDeadline(t *testing.T) {
	o := startHeldOutageScenario(t, outageLease...)
	renewed := o.nextRenewal()
	// Started again just after the leader's renewal at the retry period, so that attempt
	// finds no server (a kube-apiserver that is starting holds requests until it is ready).
	returned := o.outage(renewed, 500*time.Millisecond, 12500*time.Millisecond, "kube-apiserver", o.CP.KillAPIServer, o.CP.StartAPIServer)
	o.leaderKeptLeading(returned)
}

// P11: etcd killed two seconds after a renewal, while four calls run (held by the driver
// until the leader has renewed after the outage), and started again 5 s later (upstream's
// timings, as in a control-plane upgrade). Requests hang in the API server meanwhile; each
// renewal attempt has its own short timeout and drops its connection, so the leader still
// leads when etcd is back.
func TestLeaderKeepsItsLeaseThroughAnEtcdRestartInsideTheRenewDeadline(t *testing.T) {
	o := startHeldOutageScenario(t)
	renewed := o.nextRenewal()
	returned := o.outage(renewed, 2*time.Second, 7*time.Second, "etcd", o.CP.KillEtcd, o.CP.StartEtcd)
	o.leaderKeptLeading(returned)
}

// P7, P11: kube-apiserver down for 20 s, past the renew deadline. The leader fences (no call
// starts after its deadline) and exits; the standby takes the Lease once the server is
// back, and its caches, which waited for the server instead of backing off, see work
// created after the return at once: its first call on that work comes within seconds.
func TestAfterALongOutageTheNewLeaderServesNewWorkWithinSeconds(t *testing.T) {
	o := startOutageScenario(t, 2*time.Second, fastLease...)
	renewed := o.nextRenewal()
	if err := o.CP.KillAPIServer(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	if code := o.a.Wait(t, 30*time.Second); code == 0 {
		t.Errorf("replica-a exit code 0 after its renew deadline passed with no API server, want non-zero")
	}
	time.Sleep(time.Until(killed.Add(20 * time.Second)))
	if err := o.CP.StartAPIServer(context.Background()); err != nil {
		t.Fatal(err)
	}
	returned := time.Now()
	for i := range 4 {
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{
			Name:   fmt.Sprintf("after-%02d", i),
			Labels: map[string]string{testsidecar.WorkLabel: "yes"},
		}}
		if _, err := o.Client.CoreV1().ConfigMaps(o.Namespace).Create(context.Background(), cm, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	created := time.Now()
	o.WaitForCalls("replica-b's first call on work created after the return", func(c []testdriver.Call) bool {
		return len(newWorkCalls(callsOn(c, o.b))) > 0
	})
	calls := o.Driver.Journal()
	first := newWorkCalls(callsOn(calls, o.b))[0].Start
	t.Logf("FIGURE after a 20s outage: the new leader's first call on new work %v after the server's return (%v after the work was created)",
		first.Sub(returned).Round(time.Millisecond), first.Sub(created).Round(time.Millisecond))
	// A cache in client-go's backoff would see the work up to a minute later.
	if wait := first.Sub(created); wait > 10*time.Second {
		t.Errorf("the new leader's first call on work created after the return came %v after it, want within seconds", wait)
	}
	deadline := renewed.Add(4 * time.Second)
	for _, c := range callsOn(calls, o.a) {
		if c.Start.After(deadline) {
			t.Errorf("replica-a started a call %v after its renew deadline", c.Start.Sub(deadline))
		}
	}
	o.WaitUntil("all 8 results recorded", func() bool { return countResults(o.results(), "ok") == 8 })
	if ov := o.Driver.Overlaps(); len(ov) != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", len(ov), ov)
	}
}

// newWorkCalls are the calls on work created after the outage.
func newWorkCalls(calls []testdriver.Call) []testdriver.Call {
	var out []testdriver.Call
	for _, c := range calls {
		if strings.HasPrefix(c.VolumeName, testsidecar.VolumePrefix+"after-") {
			out = append(out, c)
		}
	}
	return out
}
