package resizer

import (
	"syscall"
	"testing"
	"time"

	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// As upstream v2.3.0: each ControllerExpandVolume call gets --resize-timeout and each
// ControllerModifyVolume call --modify-timeout; --timeout set on the command line is the
// timeout of both. The driver journals the deadline each call came with.
func TestExpandAndModifyCallsHaveTheirOwnTimeouts(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	silver := s.createClass("silver", map[string]string{"iops": "100"})
	gold := s.createClass("gold", map[string]string{"iops": "500"})
	p := s.createPair("claim", silver)

	// deadlines are the deadlines of the successful expand and modify calls since journal
	// entry from.
	deadlines := func(from int) (expand, modify []time.Duration) {
		for _, c := range s.Driver.Journal()[from:] {
			switch {
			case c.Code != "OK":
			case c.Method == testdriver.MethodControllerExpandVolume:
				expand = append(expand, c.Deadline)
			case c.Method == testdriver.MethodControllerModifyVolume:
				modify = append(modify, c.Deadline)
			}
		}
		return expand, modify
	}
	check := func(what string, got []time.Duration, above, upTo time.Duration) {
		t.Helper()
		if len(got) == 0 {
			t.Errorf("%s: no successful call", what)
		}
		for _, d := range got {
			if d <= above || d > upTo {
				t.Errorf("%s: a call came with %v to its deadline, want more than %v and at most %v", what, d, above, upTo)
			}
		}
	}

	a := s.startReplica("replica-a", "--resize-timeout=2s", "--modify-timeout=1m")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)
	s.request(p.name, "2Gi")
	s.WaitUntil("the claim has 2Gi", func() bool { return capacityOf(s.pvc(p.name)) == "2Gi" })
	s.setClass(p.name, gold)
	s.WaitUntil("the claim has 2Gi and class gold", func() bool {
		pvc := s.pvc(p.name)
		return capacityOf(pvc) == "2Gi" && ptr.Deref(pvc.Status.CurrentVolumeAttributesClassName, "") == gold
	})
	expand, modify := deadlines(0)
	check("--resize-timeout=2s", expand, 0, 2*time.Second)
	check("--modify-timeout=1m", modify, 30*time.Second, time.Minute)

	a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Fatalf("replica-a exited %d after SIGTERM, want 0", code)
	}
	from := len(s.Driver.Journal())
	b := s.startReplica("replica-b", "--timeout=3s", "--resize-timeout=1h", "--modify-timeout=1h")
	s.WaitForHolder(s.leaseName, "replica-b")
	b.WaitReady(t)
	s.request(p.name, "3Gi")
	s.WaitUntil("the claim has 3Gi", func() bool { return capacityOf(s.pvc(p.name)) == "3Gi" })
	s.setClass(p.name, silver)
	s.WaitUntil("the claim has 3Gi and class silver", func() bool {
		pvc := s.pvc(p.name)
		return capacityOf(pvc) == "3Gi" && ptr.Deref(pvc.Status.CurrentVolumeAttributesClassName, "") == silver
	})
	expand, modify = deadlines(from)
	check("--timeout=3s over --resize-timeout=1h", expand, 0, 3*time.Second)
	check("--timeout=3s over --modify-timeout=1h", modify, 0, 3*time.Second)
}
