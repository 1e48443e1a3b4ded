// Package e2e runs the built binaries as processes against a real kube-apiserver + etcd and
// the project's test CSI driver, and checks the lifecycle promises (DESIGN.md P1-P8) on what
// a user can observe: objects in the API server, calls the driver saw, exit codes, the
// Lease holder.
package e2e

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// P1, P2: SIGTERM lets in-flight calls finish and record their results, starts nothing
// new, releases the Lease and exits 0.
func TestSIGTERMCompletesInFlightCallsAndReleasesTheLease(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{})
	// The driver holds the calls until the replica drains: they are in flight at the signal
	// however slow the machine.
	release := s.Driver.Hold(testdriver.MethodCreateVolume)
	t.Cleanup(release)
	a := s.startReplica("replica-a")
	s.waitForHolder("replica-a")
	a.WaitReady(t)
	s.createWork(10)
	s.WaitForCalls("4 calls in flight on replica-a", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) == 4 })

	signalled := a.Signal(t, syscall.SIGTERM)
	s.waitDraining(a)
	release()
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("exit code %d, want 0", code)
	}
	drain := a.ExitedAt.Sub(signalled)

	calls := callsOn(s.Driver.Journal(), a)
	results := s.results()
	if len(calls) != 4 {
		t.Errorf("driver saw %d calls, want the 4 in flight at the signal and no new one", len(calls))
	}
	for _, c := range calls {
		if c.Start.After(signalled) {
			t.Errorf("call for %s started %v after the signal", c.VolumeName, c.Start.Sub(signalled))
		}
		if c.Canceled || c.Code != "OK" {
			t.Errorf("call for %s: code %s, cancelled %v; want OK, not cancelled", c.VolumeName, c.Code, c.Canceled)
		}
		if results[c.VolumeName] != "ok" {
			t.Errorf("result of %s not recorded: %q", c.VolumeName, results[c.VolumeName])
		}
	}
	if h := e2e.Holder(s.lease()); h != "" {
		t.Errorf("Lease holder after exit is %q, want empty (released)", h)
	}
	t.Logf("FIGURE drain: %d calls in flight at SIGTERM, exit 0 after %v", len(calls), drain.Round(time.Millisecond))
}

// csi_sidecars_drain_duration_seconds is recorded when the drain ends, before the Lease is
// written, so a scrape can read it before the process exits: here the leader's connection to
// the API server hangs, so its release waits, and /metrics must show the drain meanwhile.
func TestDrainDurationIsServedWhileTheLeaseIsReleased(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{})
	proxy := e2e.NewFaultProxy(t, strings.TrimPrefix(s.CP.URL(), "https://"))
	a := s.startReplica("replica-a", "--kubeconfig="+s.KubeconfigVia(proxy))
	s.waitForHolder("replica-a")
	// Leading, not only holding: a replica stopped before it leads has no drain to record.
	s.WaitUntil("replica-a leading", func() bool {
		_, body := a.Get("/metrics")
		return strings.Contains(body, `csi_sidecars_leader{sidecar="test"} 1`)
	})

	proxy.Freeze()
	a.Signal(t, syscall.SIGTERM)
	s.WaitUntil("the drain on replica-a's /metrics while it releases the Lease", func() bool {
		_, body := a.Get("/metrics")
		n, _, err := e2e.MetricTotal(body, "csi_sidecars_drain_duration_seconds", map[string]string{"sidecar": "test", "outcome": "released"})
		return err == nil && n == 1
	})
	proxy.Thaw()
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("exit code %d, want 0", code)
	}
	if h := e2e.Holder(s.lease()); h != "" {
		t.Errorf("Lease holder after exit is %q, want empty (released)", h)
	}
}

// P7 (with P1, P2): a warm standby takes the released Lease at once, without waiting for
// lease-duration or retry-period, and never overlaps the old leader on a volume.
func TestStandbyTakesOverAtOnceWithoutOverlap(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{})
	// Held until the leader drains: in flight at the signal however slow the machine.
	release := s.Driver.Hold(testdriver.MethodCreateVolume)
	t.Cleanup(release)
	a := s.startReplica("replica-a")
	s.waitForHolder("replica-a")
	b := s.startReplica("replica-b")
	b.WaitReady(t)
	// The standby must be waiting for the Lease, having seen it held, before the leader lets
	// it go: its own word for that is the only sign (it writes nothing while it waits).
	s.WaitUntil("replica-b standing by", func() bool { return strings.Contains(b.Stderr(), "Standing by for the Lease") })
	s.createWork(12)
	s.WaitForCalls("4 calls in flight on replica-a", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) == 4 })

	a.Signal(t, syscall.SIGTERM)
	s.waitDraining(a)
	release()
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("leader exit code %d, want 0", code)
	}
	s.WaitForCalls("replica-b's first call", func(c []testdriver.Call) bool { return len(callsOn(c, b)) > 0 })
	first := callsOn(s.Driver.Journal(), b)[0].Start
	gap := first.Sub(a.ExitedAt)
	t.Logf("FIGURE takeover: standby's first call %v after the leader exited (retry period 10s, lease 30s)", gap.Round(time.Millisecond))
	if gap > 5*time.Second {
		t.Errorf("standby's first call came %v after the leader exited; a watch-triggered takeover needs far less than the 10s retry period", gap)
	}
	for _, c := range callsOn(s.Driver.Journal(), a) {
		if c.Canceled || c.Code != "OK" {
			t.Errorf("leader's call for %s: code %s, cancelled %v", c.VolumeName, c.Code, c.Canceled)
		}
	}
	s.WaitForCalls("all 12 volumes created", func(c []testdriver.Call) bool {
		done := map[string]bool{}
		for _, call := range c {
			if call.Method == testdriver.MethodCreateVolume && call.Code == "OK" {
				done[call.VolumeName] = true
			}
		}
		return len(done) == 12
	})
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", len(o), o)
	}
	if h := e2e.Holder(s.lease()); h != "replica-b" {
		t.Errorf("Lease holder %q, want replica-b", h)
	}
}

// P3: when the drain outlasts --drain-timeout, in-flight calls are cancelled, the Lease is
// kept (left to expire) and the exit code is non-zero.
func TestDrainDeadlineCancelsCallsAndKeepsTheLease(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 20 * time.Second}})
	a := s.startReplica("replica-a", "--drain-timeout=1s")
	s.waitForHolder("replica-a")
	a.WaitReady(t)
	s.createWork(2)
	s.WaitForCalls("2 calls in flight", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) == 2 })

	signalled := a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 15*time.Second); code == 0 {
		t.Errorf("exit code 0, want non-zero after the drain deadline")
	}
	t.Logf("FIGURE drain deadline 1s: exited after %v", a.ExitedAt.Sub(signalled).Round(time.Millisecond))
	for _, c := range callsOn(s.Driver.Journal(), a) {
		if c.CallerGone.IsZero() {
			t.Errorf("call for %s was not cancelled by the drain deadline", c.VolumeName)
		}
	}
	if h := e2e.Holder(s.lease()); h != "replica-a" {
		t.Errorf("Lease holder %q, want replica-a (kept, left to expire)", h)
	}
}

// P14: when the drain deadline passes and only API writes are left (results waiting for
// tokens of a spent --kube-api-qps budget), nothing of the term runs in the driver: the
// Lease is released at once instead of left to expire, and no driver call started after
// the signal.
func TestDrainDeadlineWithNoCallInTheDriverReleasesTheLease(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 100 * time.Millisecond}})
	// One write a second: calls end ten times faster than their results can be recorded,
	// so at the signal every worker waits for a token.
	a := s.startReplica("replica-a", "--drain-timeout=1s", "--kube-api-qps=1", "--kube-api-burst=1")
	s.waitForHolder("replica-a")
	a.WaitReady(t)
	s.createWork(30)
	// A call starts only after a result took its token, a second apart: the signal follows
	// the fifth call's start, so that no call is about to start while the process receives it.
	s.WaitForCalls("4 CreateVolume calls ended on replica-a and a fifth started", func(c []testdriver.Call) bool {
		started, ended := 0, 0
		for _, call := range callsOn(c, a) {
			if call.Method == testdriver.MethodCreateVolume {
				started++
				if call.Done() {
					ended++
				}
			}
		}
		return ended >= 4 && started >= 5
	})

	signalled := a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 30*time.Second); code == 0 {
		t.Errorf("exit code 0, want non-zero: results were left unrecorded")
	}
	for _, c := range callsOn(s.Driver.Journal(), a) {
		if c.Start.After(signalled) {
			t.Errorf("call for %s started %v after the signal", c.VolumeName, c.Start.Sub(signalled))
		}
	}
	if h := e2e.Holder(s.lease()); h != "" {
		t.Errorf("Lease holder after exit is %q, want empty (released: no call in the driver)", h)
	}
	t.Logf("FIGURE drain deadline with writes only: exited after %v", a.ExitedAt.Sub(signalled).Round(time.Millisecond))
}

// P5: a second signal during the drain exits at once, non-zero.
func TestSecondSignalExitsAtOnce(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 30 * time.Second}})
	a := s.leaderBusy("replica-a", 1, "--drain-timeout=60s")

	a.Signal(t, syscall.SIGTERM)
	s.waitDraining(a)
	a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 10*time.Second); code == 0 {
		t.Errorf("exit code 0 after a second signal, want non-zero")
	}
	if e2e.Running(callsOn(s.Driver.Journal(), a)) != 1 {
		t.Errorf("the process waited for the call instead of exiting at once")
	}
}

// P4: a standby exits 0 promptly on SIGTERM and the leader is untouched.
func TestStandbyExitsPromptlyOnSIGTERM(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{})
	a := s.startReplica("replica-a")
	s.waitForHolder("replica-a")
	b := s.startReplica("replica-b")
	b.WaitReady(t)
	renewed := s.lease().Spec.RenewTime

	signalled := b.Signal(t, syscall.SIGTERM)
	if code := b.Wait(t, 10*time.Second); code != 0 {
		t.Errorf("standby exit code %d, want 0", code)
	}
	t.Logf("FIGURE standby exit: %v after SIGTERM", b.ExitedAt.Sub(signalled).Round(time.Millisecond))
	if !a.Running() {
		t.Errorf("leader exited with %d", a.ExitCode)
	}
	l := s.lease()
	if e2e.Holder(l) != "replica-a" {
		t.Errorf("Lease holder %q, want replica-a", e2e.Holder(l))
	}
	if l.Spec.RenewTime.Before(renewed) {
		t.Errorf("Lease renew time went back")
	}
}

// P6: when another identity takes the Lease, the leader cancels its in-flight calls at once
// and exits non-zero without touching the Lease.
func TestLeaseTakenAwayFencesInFlightCalls(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 30 * time.Second}})
	a := s.startReplica("replica-a")
	s.waitForHolder("replica-a")
	a.WaitReady(t)
	s.createWork(3)
	s.WaitForCalls("3 calls in flight", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) == 3 })

	l := s.lease()
	l.Spec.HolderIdentity = ptr.To("intruder")
	l.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
	if _, err := s.Client.CoordinationV1().Leases(s.Namespace).Update(context.Background(), l, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	taken := time.Now()
	if code := a.Wait(t, 15*time.Second); code == 0 {
		t.Errorf("exit code 0 after losing the Lease, want non-zero")
	}
	t.Logf("FIGURE fencing: exited %v after the Lease was taken", a.ExitedAt.Sub(taken).Round(time.Millisecond))
	for _, c := range callsOn(s.Driver.Journal(), a) {
		if c.CallerGone.IsZero() {
			t.Errorf("call for %s not cancelled after the Lease was lost", c.VolumeName)
		} else {
			t.Logf("FIGURE fencing: call for %s cancelled %v after the Lease was taken", c.VolumeName, c.CallerGone.Sub(taken).Round(time.Millisecond))
		}
	}
	if h := e2e.Holder(s.lease()); h != "intruder" {
		t.Errorf("Lease holder %q, want intruder (the fenced leader must not write it)", h)
	}
}

// Bad flags fail fast with the flag's name and exit code 2, for both binaries.
func TestBadFlagsFailFastNamingTheFlag(t *testing.T) {
	t.Parallel()
	e2e.RequireBinaries(t, binDir)
	for _, args := range [][]string{
		{"csi-sidecars", "attacher", "--kube-api-qps=lots"},
		{"csi-sidecars", "resizer", "-leader-election-lease-duration=soon"},
		{"csi-test-sidecar", "test", "--drain-timeout=-1s"},
		{"csi-test-sidecar", "test", "--workers=0"},
		{"csi-test-sidecar", "test", "--leader-election", "--leader-election-renew-deadline=20s"},
	} {
		out, err := exec.Command(filepath.Join(binDir, args[0]), args[1:]...).CombinedOutput()
		code := e2e.ExitCode(err)
		flag := strings.SplitN(strings.TrimLeft(args[len(args)-1], "-"), "=", 2)[0]
		if code != 2 || !strings.Contains(string(out), flag) || strings.Contains(string(out), "panic") {
			t.Errorf("%v: exit %d, output %q; want exit 2 naming %s", args, code, out, flag)
		}
	}
}

// Every subcommand shows the shared flags.
func TestHelpShowsSharedFlags(t *testing.T) {
	t.Parallel()
	e2e.RequireBinaries(t, binDir)
	for _, args := range [][]string{{"--help"}, {"attacher", "--help"}, {"resizer", "--help"}, {"provisioner", "--help"}} {
		out, err := exec.Command(filepath.Join(binDir, "csi-sidecars"), args...).CombinedOutput()
		if err != nil {
			t.Fatalf("%v: %v", args, err)
		}
		for _, f := range []string{"--csi-address", "--leader-election-namespace", "--drain-timeout", "--feature-gates", "--http-endpoint", "--metrics-path", "--kube-api-qps", "--logging-format"} {
			if !strings.Contains(string(out), f) {
				t.Errorf("%v: help lacks %s", args, f)
			}
		}
	}
}

// An unreachable driver socket or API server is retried and reported on /readyz, never a
// crash, and SIGTERM still ends the process cleanly.
func TestUnreachableDriverAndAPIServerAreReportedAndRetried(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{})
	cases := []struct {
		name, want string
		args       []string
	}{
		{"no-driver", "connecting to the CSI driver", []string{"--csi-address=" + filepath.Join(s.Dir, "absent.sock")}},
		{"no-apiserver", "API server not reachable", []string{"--kubeconfig=" + e2e.WriteKubeconfig(t, s.Dir, "https://127.0.0.1:1")}},
	}
	for _, c := range cases {
		r := s.startReplica(c.name, c.args...)
		var body string
		s.WaitUntil(c.name+" reports "+c.want, func() bool {
			code, b := r.Get("/readyz")
			body = b
			return code == 503 && strings.Contains(b, c.want)
		})
		if !r.Running() {
			t.Fatalf("%s exited: %s", c.name, r.Stderr())
		}
		r.Signal(t, syscall.SIGTERM)
		if code := r.Wait(t, 10*time.Second); code != 0 {
			t.Errorf("%s: exit %d after SIGTERM, want 0", c.name, code)
		}
		if strings.Contains(r.Stderr(), "panic") {
			t.Errorf("%s panicked", c.name)
		}
		t.Logf("%s: /readyz said %q", c.name, body)
	}
}

// Losing the driver while leading stops intake and exits 1; the Lease is released only if
// nothing was in flight, since the driver may still be working on what it was told.
func TestDriverLossReleasesTheLeaseOnlyWhenIdle(t *testing.T) {
	t.Parallel()
	for _, busy := range []bool{false, true} {
		name := map[bool]string{false: "idle", true: "busy"}[busy]
		t.Run(name, func(t *testing.T) {
			s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 30 * time.Second}})
			a := s.startReplica("replica-a")
			s.waitForHolder("replica-a")
			a.WaitReady(t)
			want := ""
			if busy {
				want = "replica-a"
				s.createWork(2)
				s.WaitForCalls("2 calls in flight", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) == 2 })
			}
			a.Driver.Stop()
			if code := a.Wait(t, 30*time.Second); code != 1 {
				t.Errorf("exit code %d after losing the driver, want 1", code)
			}
			if h := e2e.Holder(s.lease()); h != want {
				t.Errorf("Lease holder %q, want %q", h, want)
			}
		})
	}
}

// The diagnostics endpoint serves standbys too: health, leader-election health and the
// core's metrics, which tell the leader from the standby and count calls in flight.
func TestMetricsAndHealthOnLeaderAndStandby(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 10 * time.Second}})
	a := s.startReplica("replica-a")
	s.waitForHolder("replica-a")
	b := s.startReplica("replica-b")
	a.WaitReady(t)
	b.WaitReady(t)
	s.createWork(3)
	s.WaitForCalls("3 calls in flight", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) == 3 })

	for _, c := range []struct {
		r    *e2e.Replica
		want []string
	}{
		{a, []string{`csi_sidecars_leader{sidecar="test"} 1`, `csi_sidecars_inflight_operations{sidecar="test"} 3`, `grpc_status_code="OK",method_name="/csi.v1.Identity/Probe"}`,
			`leader_election_master_status{name="` + s.leaseName + `"} 1`}},
		// The standby has the 3 items in its queue too, to take over warm, but they are
		// nobody's wait: its queue figures stay at zero until it leads.
		{b, []string{`csi_sidecars_leader{sidecar="test"} 0`, `workqueue_depth{name="test"} 0` + "\n", `workqueue_adds_total{name="test"} 0` + "\n", "go_goroutines",
			`csi_sidecars_queue_waiting_items{queue="test",sidecar="test"} 0` + "\n", `csi_sidecars_queue_oldest_waiting_seconds{queue="test",sidecar="test"} 0` + "\n"}},
	} {
		for _, path := range []string{"/healthz", "/healthz/leader-election", "/readyz"} {
			if code, body := c.r.Get(path); code != 200 {
				t.Errorf("%s %s: %d %s", c.r.Name, path, code, body)
			}
		}
		_, metrics := c.r.Get("/metrics")
		for _, w := range c.want {
			if !strings.Contains(metrics, w) {
				t.Errorf("%s /metrics lacks %s", c.r.Name, w)
			}
		}
	}
}

// P7: a leader that dies without releasing (SIGKILL) leaves the Lease to expire; the standby
// takes it when it expires by the standby's own observation, not at its next retry period.
func TestStandbyTakesAnExpiredLeaseWhenItExpires(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: time.Second}})
	timing := []string{"--leader-election-lease-duration=6s", "--leader-election-renew-deadline=4s", "--leader-election-retry-period=2s"}
	a := s.startReplica("replica-a", timing...)
	s.waitForHolder("replica-a")
	b := s.startReplica("replica-b", timing...)
	b.WaitReady(t)
	s.createWork(8)
	s.WaitForCalls("a call in flight on replica-a", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) > 0 })

	killed := a.Signal(t, syscall.SIGKILL)
	a.Wait(t, 10*time.Second)
	s.WaitForCalls("replica-b's first call", func(c []testdriver.Call) bool { return len(callsOn(c, b)) > 0 })
	gap := callsOn(s.Driver.Journal(), b)[0].Start.Sub(killed)
	t.Logf("FIGURE expiry takeover: standby's first call %v after SIGKILL of the leader (lease 6s, renewed every 2s)", gap.Round(time.Millisecond))
	if gap > 9*time.Second { // 6 s, plus the watch's delay and a loaded machine's stalls
		t.Errorf("standby took %v; the Lease expired at most 6s after the kill (a polling standby could need up to 10s)", gap)
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", len(o), o)
	}
}

// --feature-gates=ReleaseLeaderElectionOnExit=false keeps upstream's old behaviour: the
// drain still completes (exit 0) but the Lease is left to expire.
func TestReleaseGateOffLeavesTheLeaseToExpire(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: time.Second}})
	a := s.startReplica("replica-a", "--feature-gates=ReleaseLeaderElectionOnExit=false")
	s.waitForHolder("replica-a")
	a.WaitReady(t)
	s.createWork(1)
	s.WaitForCalls("a call in flight", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) == 1 })
	a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("exit code %d, want 0", code)
	}
	if r := s.results()["vol-work-00"]; r != "ok" {
		t.Errorf("result %q, want ok", r)
	}
	if h := e2e.Holder(s.lease()); h != "replica-a" {
		t.Errorf("Lease holder %q, want replica-a (not released with the gate off)", h)
	}
}

// Upstream's --version prints the version and exits 0, on the binary and on a subcommand.
func TestVersionFlag(t *testing.T) {
	t.Parallel()
	e2e.RequireBinaries(t, binDir)
	for _, args := range [][]string{{"--version"}, {"attacher", "--version"}, {"provisioner", "--version", "--csi-address=/x"}} {
		out, err := exec.Command(filepath.Join(binDir, "csi-sidecars"), args...).CombinedOutput()
		if err != nil || !strings.HasPrefix(string(out), "csi-sidecars ") {
			t.Errorf("%v: %v, output %q; want the version and exit 0", args, err, out)
		}
	}
}

// --enable-pprof serves Go's profiles on the diagnostics endpoint, as upstream's
// provisioner; without it they are not served.
func TestEnablePprofServesProfilesOnTheHTTPEndpoint(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{})
	on := s.startReplica("with-pprof", "--enable-pprof")
	off := s.startReplica("without-pprof")
	on.WaitReady(t)
	off.WaitReady(t)
	if code, body := on.Get("/debug/pprof/"); code != 200 || !strings.Contains(body, "goroutine") {
		t.Errorf("with --enable-pprof: /debug/pprof/ %d", code)
	}
	if code, _ := off.Get("/debug/pprof/"); code != 404 {
		t.Errorf("without --enable-pprof: /debug/pprof/ %d, want 404", code)
	}
}

// A driver that replaced an in-tree plugin gets upstream's "migrated" label on its CSI call
// metrics; any other driver does not.
func TestMigratedDriverGetsTheMigratedMetricsLabel(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		driver string
		want   bool
	}{{"ebs.csi.aws.com", true}, {"", false}} {
		s := newScenario(t, testdriver.Config{DriverName: c.driver})
		a := s.startReplica("replica-a")
		a.WaitReady(t)
		_, metrics := a.Get("/metrics")
		if !strings.Contains(metrics, "csi_sidecar_operations_seconds_count{") {
			t.Fatalf("driver %q: no csi_sidecar_operations_seconds metrics (the probe's calls) to look at", s.Driver.DriverName())
		}
		if got := strings.Contains(metrics, `migrated="`); got != c.want {
			t.Errorf("driver %q: migrated label on csi_sidecar_operations_seconds %v, want %v", s.Driver.DriverName(), got, c.want)
		}
	}
}

// A backlog is visible: the leader exports how many items wait for a worker and the age of
// the oldest, and with --log-backlog-interval logs them while they wait.
func TestBacklogIsExportedAndLogged(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 10 * time.Second}})
	a := s.startReplica("replica-a", "--workers=1", "--log-backlog-interval=100ms")
	s.waitForHolder("replica-a")
	a.WaitReady(t)
	s.createWork(5)
	s.WaitForCalls("one call in flight", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) == 1 })
	s.WaitUntil("4 items waiting on /metrics, the oldest for a while", func() bool {
		_, metrics := a.Get("/metrics")
		return strings.Contains(metrics, `csi_sidecars_queue_waiting_items{queue="test",sidecar="test"} 4`) &&
			!strings.Contains(metrics, `csi_sidecars_queue_oldest_waiting_seconds{queue="test",sidecar="test"} 0`+"\n")
	})
	s.WaitUntil("a backlog log line", func() bool { return strings.Contains(a.Stderr(), `"Backlog" sidecar="test" queue="test" waiting=4`) })
}
