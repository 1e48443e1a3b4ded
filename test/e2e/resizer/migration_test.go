package resizer

import (
	"context"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// CSI migration: the test driver registered under the name of the CSI driver that replaces
// the in-tree kubernetes.io/aws-ebs plugin expands an in-tree awsElasticBlockStore PV once
// the PVC names it in volume.kubernetes.io/storage-resizer (kube-controller-manager's part,
// played by the test), through ControllerExpandVolume with the translated volume handle;
// the PV keeps its in-tree source, and the call's metrics say migrated="true", as upstream.
func TestMigratedInTreePVIsExpanded(t *testing.T) {
	const driver = "ebs.csi.aws.com"
	s := newScenario(t, testdriver.Config{DriverName: driver})
	p, pv := s.createClaimFirst("claim", "")
	pv.Spec.PersistentVolumeSource = v1.PersistentVolumeSource{AWSElasticBlockStore: &v1.AWSElasticBlockStoreVolumeSource{VolumeID: "aws://us-east-1a/" + p.volumeID, FSType: "ext4"}}
	s.createPV(pv)
	a := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	// The user asks for more; kube-controller-manager hands the resize to the CSI driver.
	pvc := s.pvc(p.name)
	pvc.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse("2Gi")
	pvc.Annotations = map[string]string{"volume.kubernetes.io/storage-resizer": driver}
	if _, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Update(context.Background(), pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the PVC is expanded", func() bool { return capacityOf(s.pvc(p.name)) == "2Gi" })

	got := s.pvObject(p.pv)
	if got.Spec.CSI != nil || got.Spec.AWSElasticBlockStore == nil || got.Spec.AWSElasticBlockStore.VolumeID != "aws://us-east-1a/"+p.volumeID {
		t.Errorf("PV source %+v, want the in-tree source kept", got.Spec.PersistentVolumeSource)
	}
	if c := pvCapacity(got); c != "2Gi" {
		t.Errorf("PV capacity %s, want 2Gi", c)
	}
	calls := expandCalls(s.Driver.Journal())
	if len(calls) != 1 || len(calls[p.volumeID]) != 1 || calls[p.volumeID][0].Code != "OK" {
		t.Errorf("ControllerExpandVolume calls %+v, want one OK for the translated handle %s", calls, p.volumeID)
	}
	if v, _ := s.Driver.Volume(p.volumeID); v.CapacityBytes != 2<<30 {
		t.Errorf("backend volume %d bytes, want 2Gi", v.CapacityBytes)
	}
	_, metrics := a.Get("/metrics")
	migrated := false
	for _, line := range strings.Split(metrics, "\n") {
		if strings.HasPrefix(line, "csi_sidecar_operations_seconds_count{") && strings.Contains(line, `method_name="/csi.v1.Controller/ControllerExpandVolume"`) {
			migrated = strings.Contains(line, `migrated="true"`)
			if !migrated {
				t.Errorf("metrics %q, want migrated=\"true\"", line)
			}
		}
	}
	if !migrated {
		t.Errorf("no ControllerExpandVolume metrics with migrated=\"true\"")
	}
}
