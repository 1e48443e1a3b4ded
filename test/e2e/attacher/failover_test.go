package attacher

import (
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

const (
	// failoverVolumes is twice --worker-threads (10): half are in flight on the leader at
	// the signal, half are left for the standby.
	failoverVolumes  = 20
	inFlightAtSignal = 10
	publishLatency   = 3 * time.Second
)

// shortLease lets a standby take an unreleased Lease within seconds.
var shortLease = []string{
	"--leader-election-lease-duration=6s",
	"--leader-election-renew-deadline=4s",
	"--leader-election-retry-period=1s",
}

// failover is what one failover run observed.
type failover struct {
	s              *scenario
	leader, backup *e2e.Replica
	signalled      time.Time
	exitCode       int
	// leaderCalls are the leader's publishes; attachedAtExit names the VolumeAttachments
	// attached when the leader had exited (read at once, well within one publish latency,
	// so only the leader can have attached them).
	leaderCalls    []testdriver.Call
	attachedAtExit map[string]bool
	backupFirst    time.Time

	drain, takeover, allAttached time.Duration
	overlaps                     int
	writesPerAttach              float64
}

// runFailover runs two attacher replicas, creates failoverVolumes VolumeAttachments with a
// slow ControllerPublishVolume, sends sig to the leader while inFlightAtSignal publishes
// run, and waits until the standby attached the rest.
func runFailover(t testing.TB, sig syscall.Signal, extra ...string) *failover {
	t.Helper()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodControllerPublishVolume: publishLatency}})
	s.volumes(failoverVolumes)
	flags := append(append([]string{}, fastAPI...), extra...)
	f := &failover{s: s}
	f.leader = s.start("replica-a", flags...)
	s.WaitForHolder(s.leaseName, "replica-a")
	f.leader.WaitReady(t)
	f.backup = s.start("replica-b", flags...)
	f.backup.WaitReady(t)

	before := s.apiWrites()
	s.attach(failoverVolumes)
	s.WaitForCalls("publishes in flight on the leader", func(c []testdriver.Call) bool {
		return e2e.Running(e2e.CallsOn(c, f.leader, testdriver.MethodControllerPublishVolume)) == inFlightAtSignal
	})
	f.signalled = f.leader.Signal(t, sig)
	f.exitCode = f.leader.Wait(t, 30*time.Second)
	f.attachedAtExit = map[string]bool{}
	for name, va := range s.attachments() {
		if va.Status.Attached {
			f.attachedAtExit[name] = true
		}
	}
	f.drain = f.leader.ExitedAt.Sub(f.signalled)

	s.WaitForCalls("the standby's first publish", func(c []testdriver.Call) bool {
		return len(e2e.CallsOn(c, f.backup, testdriver.MethodControllerPublishVolume)) > 0
	})
	f.backupFirst = e2e.CallsOn(s.Driver.Journal(), f.backup, testdriver.MethodControllerPublishVolume)[0].Start
	f.takeover = f.backupFirst.Sub(f.leader.ExitedAt)
	s.waitAllAttached(failoverVolumes)
	f.allAttached = time.Since(f.signalled)
	f.leaderCalls = e2e.CallsOn(s.Driver.Journal(), f.leader, testdriver.MethodControllerPublishVolume)
	f.overlaps = len(s.Driver.Overlaps())
	f.writesPerAttach = (s.apiWrites() - before) / failoverVolumes
	return f
}

// The standby's calls, by volume.
func (f *failover) backupVolumes() map[string]bool {
	out := map[string]bool{}
	for _, c := range e2e.CallsOn(f.s.Driver.Journal(), f.backup, testdriver.MethodControllerPublishVolume) {
		out[c.VolumeID] = true
	}
	return out
}

// P1, P2, P7 for the attacher: SIGTERM lets every in-flight publish finish and be recorded
// by the old leader, which exits 0 and releases the Lease; the warm standby's first call
// comes at once and it attaches the rest; no two operations overlap on a volume.
func TestSIGTERMDuringPublishesFailsOverWithoutLoss(t *testing.T) {
	f := runFailover(t, syscall.SIGTERM)

	if f.exitCode != 0 {
		t.Errorf("leader exit code %d, want 0", f.exitCode)
	}
	if len(f.leaderCalls) != inFlightAtSignal {
		t.Errorf("leader made %d publishes, want the %d in flight at the signal and no new one", len(f.leaderCalls), inFlightAtSignal)
	}
	byVolume := map[string]string{}
	for name, va := range f.s.attachments() {
		byVolume[volumeOf(f.s, va.Spec.Source.PersistentVolumeName)] = name
	}
	backup := f.backupVolumes()
	for _, c := range f.leaderCalls {
		if c.Start.After(f.signalled) {
			t.Errorf("publish of %s started %v after the signal", c.VolumeID, c.Start.Sub(f.signalled))
		}
		if c.Code != "OK" || c.Canceled || !c.CallerGone.IsZero() {
			t.Errorf("leader's publish of %s: code %s, cancelled %v, caller gone at %v; want completed", c.VolumeID, c.Code, c.Canceled, c.CallerGone)
		}
		if !f.attachedAtExit[byVolume[c.VolumeID]] {
			t.Errorf("%s (volume %s) was not attached when the leader exited: the leader did not record its publish", byVolume[c.VolumeID], c.VolumeID)
		}
		if backup[c.VolumeID] {
			t.Errorf("the standby published %s again, which the old leader had attached", c.VolumeID)
		}
	}
	if f.overlaps != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", f.overlaps, f.s.Driver.Overlaps())
	}
	if h := holder(f.s); h != "replica-b" {
		t.Errorf("Lease holder %q, want replica-b", h)
	}
	t.Logf("FIGURE failover SIGTERM: %d publishes in flight (%v each) drained in %v, exit %d", len(f.leaderCalls), publishLatency, f.drain.Round(time.Millisecond), f.exitCode)
	t.Logf("FIGURE failover SIGTERM: standby's first call %v after the leader exited (retry period 10s)", f.takeover.Round(time.Millisecond))
	t.Logf("FIGURE failover SIGTERM: all %d attached %v after the signal, %d overlaps, %.2f API writes per attach", failoverVolumes, f.allAttached.Round(time.Millisecond), f.overlaps, f.writesPerAttach)
	if f.takeover > time.Second {
		t.Errorf("standby's first call came %v after the leader exited, want < 1s (the retry period is 10s)", f.takeover)
	}
}

// SIGKILL: nothing is released, the standby waits out the Lease, and no attachment is lost
// or overlaps the dead leader's operations, which the driver finishes on its own.
func TestSIGKILLDuringPublishesLosesNoAttachment(t *testing.T) {
	f := runFailover(t, syscall.SIGKILL, shortLease...)

	for _, c := range f.leaderCalls {
		if c.End.After(f.backupFirst) {
			t.Errorf("the standby started at %v while the dead leader's publish of %s ran until %v", f.backupFirst, c.VolumeID, c.End)
		}
	}
	if f.overlaps != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", f.overlaps, f.s.Driver.Overlaps())
	}
	for _, v := range f.s.Driver.Volumes() {
		if !hasKey(v.Published, f.s.nodeID) {
			t.Errorf("volume %s not published to the node: %v", v.ID, v.Published)
		}
	}
	if h := holder(f.s); h != "replica-b" {
		t.Errorf("Lease holder %q, want replica-b", h)
	}
	t.Logf("FIGURE failover SIGKILL: standby's first call %v after the leader died (lease 6s, retry 1s); all %d attached %v after the kill, %d overlaps, %.2f API writes per attach",
		f.takeover.Round(time.Millisecond), failoverVolumes, f.allAttached.Round(time.Millisecond), f.overlaps, f.writesPerAttach)
}

// BenchmarkAttacherFailover is the SIGTERM failover scenario, reported as metrics:
// leader drain, standby's first call after the leader's exit, signal to all attached (in
// seconds), overlapping operations, and API writes (PATCH/UPDATE of VolumeAttachments and
// PVs, counted by the API server's apiserver_request_total) per attach.
func BenchmarkAttacherFailover(b *testing.B) {
	var sum failover
	for i := range b.N {
		f := runFailover(b, syscall.SIGTERM)
		if b.Failed() {
			b.Fatalf("failover run %d failed", i)
		}
		sum.drain += f.drain
		sum.takeover += f.takeover
		sum.allAttached += f.allAttached
		sum.overlaps += f.overlaps
		sum.writesPerAttach += f.writesPerAttach
	}
	n := float64(b.N)
	b.ReportMetric(sum.drain.Seconds()/n, "drain-s")
	b.ReportMetric(sum.takeover.Seconds()/n, "standby-first-call-s")
	b.ReportMetric(sum.allAttached.Seconds()/n, "all-attached-s")
	b.ReportMetric(float64(sum.overlaps)/n, "overlaps")
	b.ReportMetric(sum.writesPerAttach/n, "writes/attach")
}

func volumeOf(s *scenario, pvName *string) string {
	if pvName == nil {
		return ""
	}
	pv, err := s.Client.CoreV1().PersistentVolumes().Get(s.T.Context(), *pvName, metav1.GetOptions{})
	if err != nil || pv.Spec.CSI == nil {
		return ""
	}
	return pv.Spec.CSI.VolumeHandle
}

func holder(s *scenario) string { return e2e.Holder(s.Lease(s.leaseName)) }
