package deletion

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
)

const drv = "drv.example.com"

func TestFinalizerAndDeletionDecisions(t *testing.T) {
	fin := volumehelpers.PVDeletionProtectionFinalizer
	pv := func(policy v1.PersistentVolumeReclaimPolicy, phase v1.PersistentVolumePhase, deleting bool, finalizers ...string) *v1.PersistentVolume {
		p := &v1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: "pv", Finalizers: finalizers},
			Spec:       v1.PersistentVolumeSpec{PersistentVolumeReclaimPolicy: policy, PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: drv}}},
			Status:     v1.PersistentVolumeStatus{Phase: phase},
		}
		if deleting {
			p.DeletionTimestamp = &metav1.Time{}
		}
		return p
	}
	del, ret := v1.PersistentVolumeReclaimDelete, v1.PersistentVolumeReclaimRetain
	for _, tc := range []struct {
		name           string
		pv             *v1.PersistentVolume
		wantFinalizers []string
		wantChanged    bool
		wantDelete     bool
	}{
		{"bound Delete gets the finalizer", pv(del, v1.VolumeBound, false), []string{fin}, true, false},
		{"bound Delete keeps it", pv(del, v1.VolumeBound, false, "other", fin), []string{"other", fin}, false, false},
		{"released Delete is deleted", pv(del, v1.VolumeReleased, false, fin), []string{fin}, false, true},
		{"released Delete being deleted with finalizer is deleted", pv(del, v1.VolumeReleased, true, fin), []string{fin}, false, true},
		{"being deleted without finalizer was done", pv(del, v1.VolumeReleased, true), nil, false, false},
		{"Retain loses the finalizer, never deleted", pv(ret, v1.VolumeReleased, false, "other", fin), []string{"other"}, true, false},
		{"Retain without finalizer: nothing", pv(ret, v1.VolumeReleased, false), nil, false, false},
		{"pending Delete gets no finalizer yet", pv(del, v1.VolumePending, false), nil, false, false},
		// isDriverVolume lets in-tree volumes through only when the driver can delete them
		// (CSI migration): they are protected and deleted like the others.
		{"bound Delete in-tree volume gets the finalizer", inTree(pv(del, v1.VolumeBound, false)), []string{fin}, true, false},
		{"released Delete in-tree volume is deleted", inTree(pv(del, v1.VolumeReleased, false, fin)), []string{fin}, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, changed := desiredFinalizers(tc.pv)
			if changed != tc.wantChanged {
				t.Errorf("changed %v, want %v", changed, tc.wantChanged)
			}
			if diff := cmp.Diff(tc.wantFinalizers, got); diff != "" {
				t.Errorf("finalizers (-want +got):\n%s", diff)
			}
			if d := shouldDelete(tc.pv); d != tc.wantDelete {
				t.Errorf("shouldDelete %v, want %v", d, tc.wantDelete)
			}
		})
	}
}

// inTree gives a PersistentVolume an in-tree EBS source in place of its CSI source.
func inTree(pv *v1.PersistentVolume) *v1.PersistentVolume {
	pv.Spec.CSI = nil
	pv.Spec.AWSElasticBlockStore = &v1.AWSElasticBlockStoreVolumeSource{VolumeID: "vol-1"}
	return pv
}

func TestVolumeTopology(t *testing.T) {
	pv := &v1.PersistentVolume{Spec: v1.PersistentVolumeSpec{NodeAffinity: &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{
		{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "zone", Operator: v1.NodeSelectorOpIn, Values: []string{"a"}}}},
	}}}}}
	if got := volumeTopology(pv); len(got) != 1 || !cmp.Equal(got[0].GetSegments(), map[string]string{"zone": "a"}) {
		t.Errorf("volumeTopology: %v, want zone=a", got)
	}
	pv.Spec.NodeAffinity.Required.NodeSelectorTerms[0].MatchExpressions[0].Values = []string{"a", "b"}
	if got := volumeTopology(pv); got != nil {
		t.Errorf("volumeTopology of a multi-value term: %v, want nil (every segment)", got)
	}
}
