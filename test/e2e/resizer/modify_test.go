package resizer

import (
	"context"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// createClass creates a VolumeAttributesClass of the scenario's driver, named after the
// scenario (classes are cluster-wide).
func (s *scenario) createClass(name string, params map[string]string) string {
	s.T.Helper()
	full := s.Namespace + "-" + name
	vac := &storagev1.VolumeAttributesClass{ObjectMeta: metav1.ObjectMeta{Name: full}, DriverName: s.Driver.DriverName(), Parameters: params}
	if _, err := s.Client.StorageV1().VolumeAttributesClasses().Create(context.Background(), vac, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	s.T.Cleanup(func() {
		_ = s.Client.StorageV1().VolumeAttributesClasses().Delete(context.Background(), full, metav1.DeleteOptions{})
	})
	return full
}

func (s *scenario) setClass(name, class string) {
	s.T.Helper()
	pvc := s.pvc(name)
	pvc.Spec.VolumeAttributesClassName = ptr.To(class)
	if _, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Update(context.Background(), pvc, metav1.UpdateOptions{}); err != nil {
		s.T.Fatalf("setting class %s on %s: %v", class, name, err)
	}
}

// A VolumeAttributesClass change is applied with ControllerModifyVolume and recorded; a
// class the driver refuses is Infeasible, and going back to the current class rolls back,
// applying that class again as upstream does (the refused call may have changed the volume).
func TestVolumeAttributesClassChange(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	silver := s.createClass("silver", map[string]string{"iops": "100"})
	gold := s.createClass("gold", map[string]string{"iops": "500"})
	bad := s.createClass("bad", map[string]string{"colour": "blue"}) // not a mutable parameter of the driver
	p := s.createPair("claim", silver)
	a := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	s.setClass(p.name, gold)
	s.WaitUntil("the PVC has class gold", func() bool {
		return ptr.Deref(s.pvc(p.name).Status.CurrentVolumeAttributesClassName, "") == gold
	})
	pvc := s.pvc(p.name)
	if pvc.Status.ModifyVolumeStatus != nil || len(pvc.Status.Conditions) != 0 {
		t.Errorf("after modification: status %+v conditions %+v", pvc.Status.ModifyVolumeStatus, pvc.Status.Conditions)
	}
	if c := ptr.Deref(s.pvObject(p.pv).Spec.VolumeAttributesClassName, ""); c != gold {
		t.Errorf("PV class %q, want %q", c, gold)
	}
	if v, _ := s.Driver.Volume(p.volumeID); v.MutableParameters["iops"] != "500" {
		t.Errorf("backend parameters %v, want iops=500", v.MutableParameters)
	}

	s.setClass(p.name, bad)
	s.WaitUntil("the bad class is infeasible", func() bool {
		st := s.pvc(p.name).Status.ModifyVolumeStatus
		return st != nil && st.Status == v1.PersistentVolumeClaimModifyVolumeInfeasible && st.TargetVolumeAttributesClassName == bad
	})
	s.setClass(p.name, gold)
	s.WaitUntil("the rollback to gold clears the modification", func() bool {
		pvc := s.pvc(p.name)
		return pvc.Status.ModifyVolumeStatus == nil && len(pvc.Status.Conditions) == 0
	})
	if c := ptr.Deref(s.pvc(p.name).Status.CurrentVolumeAttributesClassName, ""); c != gold {
		t.Errorf("class after rollback %q, want %q", c, gold)
	}
	modifies := 0
	for _, c := range s.Driver.Journal() {
		if c.Method == testdriver.MethodControllerModifyVolume {
			modifies++
		}
	}
	if modifies != 3 {
		t.Errorf("%d ControllerModifyVolume calls, want 3 (gold, refused bad, gold again)", modifies)
	}
}

// shortLease lets a standby take over soon after a leader is killed.
var shortLease = []string{"--leader-election-lease-duration=3s", "--leader-election-renew-deadline=2s", "--leader-election-retry-period=500ms"}

// A leader killed while ControllerModifyVolume runs leaves the PVC InProgress, and the
// driver finishes the call. The user then rolls back to the current class. The new leader
// has no record of how the call ended: it finishes the class in progress first, so the PVC
// records the class the volume got, then applies the rollback through the driver. Recording
// the rollback without a call would leave the volume with the other class.
func TestModifyCutOffByLeaderDeathIsFinishedBeforeRollback(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	// The driver holds the call until the test releases it, after the kill.
	release := s.Driver.Hold(testdriver.MethodControllerModifyVolume)
	t.Cleanup(release)
	silver := s.createClass("silver", map[string]string{"iops": "100"})
	gold := s.createClass("gold", map[string]string{"iops": "500"})
	p := s.createPair("claim", silver)
	a := s.startReplica("replica-a", shortLease...)
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	s.setClass(p.name, gold)
	s.WaitForCalls("replica-a's ControllerModifyVolume running", func(c []testdriver.Call) bool {
		return e2e.Running(e2e.CallsOn(c, a, testdriver.MethodControllerModifyVolume)) == 1
	})
	a.Signal(t, syscall.SIGKILL)
	a.Wait(t, 10*time.Second)
	if st := s.pvc(p.name).Status.ModifyVolumeStatus; st == nil || st.Status != v1.PersistentVolumeClaimModifyVolumeInProgress || st.TargetVolumeAttributesClassName != gold {
		t.Fatalf("after the kill: modify status %+v, want InProgress %s", st, gold)
	}
	// The driver finishes the cut-off call; later calls are not held.
	release()
	s.setClass(p.name, silver)
	s.WaitForCalls("the cut-off call finished in the driver", func(c []testdriver.Call) bool {
		calls := e2e.CallsOn(c, a, testdriver.MethodControllerModifyVolume)
		return len(calls) == 1 && calls[0].Done()
	})
	if v, _ := s.Driver.Volume(p.volumeID); v.MutableParameters["iops"] != "500" {
		t.Fatalf("backend parameters %v after the cut-off call, want iops=500", v.MutableParameters)
	}

	b := s.startReplica("replica-b", shortLease...)
	s.WaitForHolder(s.leaseName, "replica-b")
	s.WaitUntil("the PVC records the rollback", func() bool {
		pvc := s.pvc(p.name)
		return pvc.Status.ModifyVolumeStatus == nil && ptr.Deref(pvc.Status.CurrentVolumeAttributesClassName, "") == silver
	})
	if v, _ := s.Driver.Volume(p.volumeID); v.MutableParameters["iops"] != "100" {
		t.Errorf("backend parameters %v, want iops=100: the PVC records %s", v.MutableParameters, silver)
	}
	if c := ptr.Deref(s.pvObject(p.pv).Spec.VolumeAttributesClassName, ""); c != silver {
		t.Errorf("PV class %q, want %q", c, silver)
	}
	if n := len(e2e.CallsOn(s.Driver.Journal(), b, testdriver.MethodControllerModifyVolume)); n != 2 {
		t.Errorf("replica-b made %d ControllerModifyVolume calls, want 2 (gold finished, silver)", n)
	}
	// The order, from what replica-b recorded: gold finished, then silver applied.
	s.WaitUntil("two VolumeModifySuccessful events", func() bool { return len(s.modifySuccesses(p.name)) >= 2 })
	if got, want := s.modifySuccesses(p.name), []string{gold, silver}; !slices.Equal(got, want) {
		t.Errorf("VolumeModifySuccessful for %v, want %v", got, want)
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("overlapping operations: %+v", o)
	}
}

// modifySuccesses lists the classes of a PVC's VolumeModifySuccessful events, oldest first.
func (s *scenario) modifySuccesses(claim string) []string {
	s.T.Helper()
	events, err := s.Client.CoreV1().Events(s.Namespace).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + claim + ",reason=VolumeModifySuccessful"})
	if err != nil {
		s.T.Fatal(err)
	}
	// Timestamps have whole seconds; the recorder names each event <object>.<creation time
	// in hex nanoseconds>, which orders them.
	slices.SortFunc(events.Items, func(a, b v1.Event) int { return strings.Compare(a.Name, b.Name) })
	var out []string
	for _, e := range events.Items {
		// "external resizer modified volume <pvc> with vac <class> successfully"
		_, rest, _ := strings.Cut(e.Message, " with vac ")
		class, _, _ := strings.Cut(rest, " ")
		out = append(out, class)
	}
	return out
}
