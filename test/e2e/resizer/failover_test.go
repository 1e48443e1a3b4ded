package resizer

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// P1, P2, P7 for the resizer: SIGTERM during slow expansions lets every in-flight
// expansion finish and be recorded, exits 0, and the warm standby takes over the rest at
// once, never overlapping the old leader on a volume.
func TestSIGTERMDuringExpansionsFailsOverWithoutLosingWork(t *testing.T) {
	const slow = 3 * time.Second
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodControllerExpandVolume: slow}})
	const n = 10
	var pairs []pair
	for i := range n {
		pairs = append(pairs, s.createPair(fmt.Sprintf("claim-%02d", i), ""))
	}
	a := s.startReplica("replica-a", "--workers=4")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)
	b := s.startReplica("replica-b", "--workers=4")
	b.WaitReady(t)

	for _, p := range pairs {
		s.request(p.name, "2Gi")
	}
	s.WaitForCalls("4 expansions in flight on replica-a", func(c []testdriver.Call) bool {
		return e2e.Running(e2e.CallsOn(c, a, testdriver.MethodControllerExpandVolume)) == 4
	})
	signalled := a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("leader exit code %d, want 0", code)
	}
	drain := a.ExitedAt.Sub(signalled)

	// Every expansion the leader had in flight finished and was recorded before it exited.
	byVolume := map[string]pair{}
	for _, p := range pairs {
		byVolume[p.volumeID] = p
	}
	leaderCalls := e2e.CallsOn(s.Driver.Journal(), a, testdriver.MethodControllerExpandVolume)
	if len(leaderCalls) != 4 {
		t.Errorf("leader made %d expansions, want the 4 in flight at SIGTERM and no new one", len(leaderCalls))
	}
	for _, c := range leaderCalls {
		if c.Start.After(signalled) || c.Canceled || c.Code != "OK" {
			t.Errorf("leader's expansion of %s: start %v after signal, cancelled %v, code %s", c.VolumeID, c.Start.After(signalled), c.Canceled, c.Code)
		}
		if got := capacityOf(s.pvc(byVolume[c.VolumeID].name)); got != "2Gi" {
			t.Errorf("expansion of %s not recorded by the leader: capacity %s", c.VolumeID, got)
		}
	}

	s.WaitForCalls("replica-b's first expansion", func(c []testdriver.Call) bool {
		return len(e2e.CallsOn(c, b, testdriver.MethodControllerExpandVolume)) > 0
	})
	first := e2e.CallsOn(s.Driver.Journal(), b, testdriver.MethodControllerExpandVolume)[0].Start
	gap := first.Sub(a.ExitedAt)
	t.Logf("FIGURE resizer drain: 4 expansions of %v in flight at SIGTERM, exit 0 after %v", slow, drain.Round(time.Millisecond))
	t.Logf("FIGURE resizer takeover: standby's first expansion %v after the leader exited (retry period 10s)", gap.Round(time.Millisecond))
	if gap > 3*time.Second {
		t.Errorf("standby continued %v after the leader exited; want well below the 10s retry period (about 1s)", gap)
	}

	for _, p := range pairs {
		s.WaitUntil(p.name+" resized", func() bool { return capacityOf(s.pvc(p.name)) == "2Gi" })
	}
	for id, calls := range expandCalls(s.Driver.Journal()) {
		if len(calls) != 1 {
			t.Errorf("volume %s expanded %d times, want once", id, len(calls))
		}
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("overlapping operations: %+v", o)
	}
	if h := e2e.Holder(s.Lease(s.leaseName)); h != "replica-b" {
		t.Errorf("Lease holder %q, want replica-b", h)
	}
}
