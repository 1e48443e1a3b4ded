package resizer

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// ebsDriver is the CSI driver csi-translation-lib migrates the in-tree
// kubernetes.io/aws-ebs plugin to.
const ebsDriver = "ebs.csi.aws.com"

// CSI migration: an in-tree PV whose plugin is migrated to the driver is expanded through
// the driver with the translated volume handle, once kube-controller-manager named the
// driver in the PVC's storage-resizer annotation, as upstream; the PV keeps its in-tree
// source and gets the new capacity. Anything else is left alone.
func TestExpansionOfMigratedInTreePV(t *testing.T) {
	ebs := func(id string) v1.PersistentVolumeSource {
		return v1.PersistentVolumeSource{AWSElasticBlockStore: &v1.AWSElasticBlockStoreVolumeSource{VolumeID: id, FSType: "ext4"}}
	}
	for _, tc := range []struct {
		name       string
		driver     string
		source     func(id string) v1.PersistentVolumeSource
		annotation string // the PVC's storage-resizer annotation
		nodeExp    bool
		want       bool
	}{
		{name: "EBS volume handed over", driver: ebsDriver, source: ebs, annotation: ebsDriver, want: true},
		{name: "EBS volume in aws:// form", driver: ebsDriver, source: func(id string) v1.PersistentVolumeSource { return ebs("aws://us-east-1a/" + id) }, annotation: ebsDriver, want: true},
		{name: "EBS volume needing node expansion", driver: ebsDriver, source: ebs, annotation: ebsDriver, nodeExp: true, want: true},
		{name: "not handed over: the in-tree resizer's name", driver: ebsDriver, source: ebs, annotation: "kubernetes.io/aws-ebs"},
		{name: "not handed over: no annotation", driver: ebsDriver, source: ebs},
		{name: "another plugin's volume", driver: ebsDriver, annotation: ebsDriver, source: func(id string) v1.PersistentVolumeSource {
			return v1.PersistentVolumeSource{GCEPersistentDisk: &v1.GCEPersistentDiskVolumeSource{PDName: id}}
		}},
		{name: "a driver no plugin migrates to", driver: testDriver, source: ebs, annotation: testDriver},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixtureOf(t, testdriver.Config{DriverName: tc.driver, NodeExpansionRequired: tc.nodeExp})
			id := f.createVolume("vol", gi(1))
			pvc, pv := boundPair("claim", id, "2Gi", "1Gi")
			pv.Spec.PersistentVolumeSource = tc.source(id)
			if tc.annotation != "" {
				pvc.Annotations = map[string]string{annResizer: tc.annotation}
			}
			f, c := newExpansionFixtureWith(t, f, expansionOpts{}, pvc, pv)
			f.start()
			if err := c.sync("ns/claim"); err != nil {
				t.Fatal(err)
			}
			calls := f.calls(testdriver.MethodControllerExpandVolume)
			if !tc.want {
				if len(calls) != 0 {
					t.Errorf("%d ControllerExpandVolume calls, want none", len(calls))
				}
				if got := f.pvc("claim"); got.Status.AllocatedResourceStatuses != nil || len(got.Status.Conditions) != 0 {
					t.Errorf("PVC status written: %+v", got.Status)
				}
				return
			}
			if len(calls) != 1 || calls[0].VolumeID != id || calls[0].Code != "OK" {
				t.Fatalf("ControllerExpandVolume calls %+v, want one OK for %s", calls, id)
			}
			if vol, _ := f.driver.Volume(id); vol.CapacityBytes != gi(2) {
				t.Errorf("backend volume %d bytes, want 2Gi", vol.CapacityBytes)
			}
			gotPV := f.pv("pv-claim")
			if gotPV.Spec.CSI != nil || gotPV.Spec.AWSElasticBlockStore == nil {
				t.Errorf("PV source %+v, want the in-tree source kept", gotPV.Spec.PersistentVolumeSource)
			}
			if capacity := gotPV.Spec.Capacity[v1.ResourceStorage]; capacity.Cmp(resource.MustParse("2Gi")) != 0 {
				t.Errorf("PV capacity %s, want 2Gi", capacity.String())
			}
			gotPVC := f.pvc("claim")
			if tc.nodeExp {
				if gotPVC.Status.AllocatedResourceStatuses[v1.ResourceStorage] != v1.PersistentVolumeClaimNodeResizePending {
					t.Errorf("PVC status %+v, want NodeResizePending", gotPVC.Status)
				}
				return
			}
			if capacity := gotPVC.Status.Capacity[v1.ResourceStorage]; capacity.Cmp(resource.MustParse("2Gi")) != 0 {
				t.Errorf("PVC capacity %s, want 2Gi", capacity.String())
			}
		})
	}
}
