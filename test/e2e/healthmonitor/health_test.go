package healthmonitor

import (
	"context"
	"maps"
	"slices"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// With the gate on: abnormal volumes listed over several pages get their conditions in
// status.healthStatus, unchanged passes write nothing (resourceVersions stay), a volume
// healthy again is cleared, and a volume deleted between two polls costs nothing.
func TestHealthStatusOverPagesWritesOnlyChanges(t *testing.T) {
	s := newScenario(t, kube.Get(t), healthDriver())
	var pairs []pair
	for _, n := range []string{"a", "b", "c", "d", "e", "f"} {
		pairs = append(pairs, s.createPair(n))
	}
	// Five abnormal volumes: three pages of two.
	s.setHealth(pairs[0], degraded)
	s.setHealth(pairs[1], lost, down)
	s.setHealth(pairs[2], degraded)
	s.setHealth(pairs[3], down)
	s.setHealth(pairs[4], lost)
	r := s.startReplica("r1")
	s.WaitUntil("claims show their volumes' health", func() bool {
		return slices.Equal(s.conditions("b"), []string{"DataLoss/Corrupt", "Inaccessible/PathDown"}) &&
			slices.Equal(s.conditions("e"), []string{"DataLoss/Corrupt"}) && slices.Equal(s.conditions("a"), []string{"Degraded/ReplicaLost"})
	})
	if got := s.conditions("f"); got != nil {
		t.Errorf("healthy claim f shows %v", got)
	}
	if msg := s.claim("a").Status.HealthStatus.HealthConditions[0].Message; msg != degraded.Message {
		t.Errorf("claim a's message %q", msg)
	}
	names := []string{"a", "b", "c", "d", "e", "f"}
	before := s.versions(names...)
	s.passes(6) // two passes of three pages
	if after := s.versions(names...); !maps.Equal(before, after) {
		t.Errorf("unchanged passes wrote claims: %v -> %v", before, after)
	}

	// A volume deleted between two polls: claim, PV and backend volume go.
	ctx := context.Background()
	if err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Delete(ctx, "c", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := s.Client.CoreV1().PersistentVolumes().Delete(ctx, pairs[2].pv, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := s.Driver.SetVolumeHealth(pairs[2].volumeID); err != nil {
		t.Fatal(err)
	}
	// Healthy again.
	s.setHealth(pairs[0])
	s.WaitUntil("claim a cleared", func() bool { return s.claim("a").Status.HealthStatus == nil })
	s.passes(4)
	if !r.Running() {
		t.Fatalf("the monitor exited (%d)", r.ExitCode)
	}
	delete(before, "a")
	delete(before, "c")
	if after := s.versions("b", "d", "e", "f"); !maps.Equal(before, after) {
		t.Errorf("claims written that did not change: %v -> %v", before, after)
	}
	r.Signal(t, syscall.SIGTERM)
	if code := r.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("exit code %d after SIGTERM, want 0", code)
	}
}

// A SIGTERM while ControllerListVolumeHealth is in the driver: the call finishes, its
// answer is recorded, no further page is asked for, and the process exits 0.
func TestSIGTERMDuringListDrains(t *testing.T) {
	s := newScenario(t, kube.Get(t), healthDriver())
	a, b, c := s.createPair("a"), s.createPair("b"), s.createPair("c")
	s.setHealth(a, degraded)
	s.setHealth(b, degraded)
	s.setHealth(c, lost)
	release := s.Driver.Hold(testdriver.MethodControllerListVolumeHealth)
	defer release()
	r := s.startReplica("r1")
	s.WaitForCalls("a list call held in the driver", func(calls []testdriver.Call) bool {
		return len(testdriver.CallsOf(calls, testdriver.MethodControllerListVolumeHealth)) == 1
	})
	r.Signal(t, syscall.SIGTERM)
	time.Sleep(500 * time.Millisecond) // the process is draining, not gone
	if !r.Running() {
		t.Fatalf("exited (%d) while its list call was in the driver", r.ExitCode)
	}
	release()
	if code := r.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("exit code %d, want 0", code)
	}
	// The first page (a, b) was recorded; no second page was asked for.
	if got := s.conditions("a"); !slices.Equal(got, []string{"Degraded/ReplicaLost"}) {
		t.Errorf("claim a after the drain: %v", got)
	}
	if got := s.conditions("c"); got != nil {
		t.Errorf("claim c of a page never asked for: %v", got)
	}
	if n := len(s.Driver.Calls(testdriver.MethodControllerListVolumeHealth)); n != 1 {
		t.Errorf("%d list calls, want the held one only", n)
	}
}

// A standby takes over from a leader that stopped and writes nothing that is current.
func TestStandbyTakesOverWithoutRewriting(t *testing.T) {
	s := newScenario(t, kube.Get(t), healthDriver())
	a, _, c := s.createPair("a"), s.createPair("b"), s.createPair("c")
	s.setHealth(a, degraded)
	s.setHealth(c, lost)
	r1 := s.startReplica("r1")
	s.WaitForHolder(s.leaseName, "r1")
	r2 := s.startReplica("r2")
	s.WaitUntil("claims written", func() bool { return s.conditions("a") != nil && s.conditions("c") != nil })
	before := s.versions("a", "b", "c")
	r1.Signal(t, syscall.SIGTERM)
	if code := r1.Wait(t, 30*time.Second); code != 0 {
		t.Fatalf("leader exit code %d", code)
	}
	s.WaitForCalls("the new leader's passes", func(calls []testdriver.Call) bool {
		n := 0
		for _, call := range testdriver.CallsOf(calls, testdriver.MethodControllerListVolumeHealth) {
			if call.Socket == r2.Socket && call.Done() {
				n++
			}
		}
		return n >= 2
	})
	if after := s.versions("a", "b", "c"); !maps.Equal(before, after) {
		t.Errorf("the new leader rewrote current claims: %v -> %v", before, after)
	}
}

// With the gate off the API server drops status.healthStatus: upstream's events are
// written instead, once per change.
func TestEventsWhereTheGateIsOff(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cp, err := controlplane.Start(ctx, controlplane.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cp.Stop() })
	s := newScenario(t, cp, healthDriver())
	a := s.createPair("a")
	s.createPair("b")
	s.setHealth(a, degraded)
	s.startReplica("r1")
	events := func(reason string) []v1.Event {
		list, err := s.Client.CoreV1().Events(s.Namespace).List(context.Background(), metav1.ListOptions{
			FieldSelector: fields.Set{"involvedObject.name": "a", "reason": reason}.String()})
		if err != nil {
			t.Fatal(err)
		}
		return list.Items
	}
	s.WaitUntil("an abnormal event", func() bool { return len(events("VolumeConditionAbnormal")) == 1 })
	s.passes(3)
	ev := events("VolumeConditionAbnormal")
	if len(ev) != 1 || ev[0].Count > 1 || ev[0].Type != v1.EventTypeWarning || ev[0].Message != "Degraded (ReplicaLost): one replica of three lost" {
		t.Errorf("abnormal events after several passes: %+v", ev)
	}
	if h := s.claim("a").Status.HealthStatus; h != nil {
		t.Errorf("the API server kept healthStatus with the gate off: %+v", h)
	}
	s.setHealth(a)
	s.WaitUntil("a normal event", func() bool { return len(events("VolumeConditionNormal")) == 1 })
	s.passes(3)
	if ev := events("VolumeConditionNormal"); len(ev) != 1 || ev[0].Count > 1 || ev[0].Message != "The Volume returns to the healthy state" {
		t.Errorf("normal events: %+v", ev)
	}
	if ev := events("VolumeConditionAbnormal"); len(ev) != 1 || ev[0].Count > 1 {
		t.Errorf("abnormal events after recovery: %+v", ev)
	}
}
