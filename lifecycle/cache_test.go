package lifecycle

import (
	"reflect"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
)

func TestTrimForCacheDropsManagedFieldsAndKeepsTheRest(t *testing.T) {
	pvc := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "ns", Annotations: map[string]string{"a": "b"}, Finalizers: []string{"f"},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}},
		Spec: v1.PersistentVolumeClaimSpec{VolumeName: "pv"},
	}
	want := pvc.DeepCopy()
	want.ManagedFields = nil
	got, err := TrimForCache(pvc.DeepCopy())
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("trimmed claim %+v (%v), want %+v", got, err, want)
	}
	// A tombstone passes through.
	tomb := cache.DeletedFinalStateUnknown{Key: "ns/c", Obj: pvc}
	if got, err := TrimForCache(tomb); err != nil || !reflect.DeepEqual(got, tomb) {
		t.Errorf("tombstone changed: %+v", got)
	}
}

func TestTrimForCacheKeepsWhatThePodInUseCheckReads(t *testing.T) {
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "u", ResourceVersion: "7", Labels: map[string]string{"app": "x"}},
		Spec: v1.PodSpec{
			Containers: []v1.Container{{Name: "c", Image: "busybox"}},
			Volumes: []v1.Volume{
				{Name: "data", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: "claim"}}},
				{Name: "tmp", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{}}},
			},
		},
		Status: v1.PodStatus{Phase: v1.PodRunning, Conditions: []v1.PodCondition{{Type: v1.PodReady}}},
	}
	got, err := TrimForCache(pod)
	if err != nil {
		t.Fatal(err)
	}
	p := got.(*v1.Pod)
	if p.Name != "p" || p.Namespace != "ns" || p.UID != "u" || p.ResourceVersion != "7" || p.Status.Phase != v1.PodRunning {
		t.Errorf("identity or phase lost: %+v", p)
	}
	if len(p.Spec.Volumes) != 1 || p.Spec.Volumes[0].PersistentVolumeClaim.ClaimName != "claim" {
		t.Errorf("volumes %+v, want only the claim", p.Spec.Volumes)
	}
	if len(p.Spec.Containers) != 0 || len(p.Labels) != 0 || len(p.Status.Conditions) != 0 {
		t.Errorf("fields no sidecar reads were kept: %+v", p)
	}
}
