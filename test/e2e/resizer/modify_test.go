package resizer

import (
	"context"
	"testing"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testdriver"
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
// class the driver refuses is Infeasible, and going back to the current class rolls back.
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
	if modifies != 2 {
		t.Errorf("%d ControllerModifyVolume calls, want 2 (gold, refused bad; the rollback needs none)", modifies)
	}
}
