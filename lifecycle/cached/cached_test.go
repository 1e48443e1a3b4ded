package cached

import (
	"fmt"
	"maps"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"
	"unsafe"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
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
	got, err := Trim(pvc.DeepCopy())
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("trimmed claim %+v (%v), want %+v", got, err, want)
	}
	// A tombstone passes through.
	tomb := cache.DeletedFinalStateUnknown{Key: "ns/c", Obj: pvc}
	if got, err := Trim(tomb); err != nil || !reflect.DeepEqual(got, tomb) {
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
	got, err := Trim(pod)
	if err != nil {
		t.Fatal(err)
	}
	p := got.(*Pod)
	if p.Name != "p" || p.Namespace != "ns" || p.UID != "u" || p.ResourceVersion != "7" || p.Ended {
		t.Errorf("identity or phase lost: %+v", p)
	}
	if !reflect.DeepEqual(p.Claims, []string{"claim"}) {
		t.Errorf("claims %q, want only the claim", p.Claims)
	}
	if len(p.Labels) != 0 {
		t.Errorf("labels kept: %+v", p)
	}
	if cp := p.DeepCopyObject().(*Pod); !reflect.DeepEqual(cp, p) {
		t.Errorf("copy %+v differs from %+v", cp, p)
	}
	for _, phase := range []v1.PodPhase{v1.PodSucceeded, v1.PodFailed} {
		pod.Status.Phase = phase
		if got, _ := Trim(pod); !got.(*Pod).Ended {
			t.Errorf("a Pod in phase %s is not ended", phase)
		}
	}
}

// The cache transform changes nothing a reader sees: every field keeps its value. Repeated
// strings and equal maps of strings are held once; an object's own strings stay its own.
func TestCacheTransformSharesRepeatedStringsAndMapsAndKeepsEveryValue(t *testing.T) {
	transform := NewTransform()
	var got []*v1.PersistentVolume
	for i := range 3 {
		pv := samplePV(i)
		pv.ManagedFields = nil
		// Built anew, as a decoder does: equal content, separate memory.
		pv.Spec.CSI.Driver = strings.Clone(pv.Spec.CSI.Driver)
		pv.Annotations = maps.Clone(pv.Annotations)
		want := pv.DeepCopy()
		out, err := transform(pv)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(out, want) {
			t.Fatalf("transformed PV differs from the original:\n%+v\n%+v", out, want)
		}
		got = append(got, out.(*v1.PersistentVolume))
		// A collection between two objects' transforms drops what nothing holds: the
		// shared copies must outlive it, as they do between a cache's list and its watch.
		runtime.GC()
	}
	a, b := got[0], got[2]
	if unsafe.StringData(a.Spec.CSI.Driver) != unsafe.StringData(b.Spec.CSI.Driver) {
		t.Error("the driver's name is held twice")
	}
	if reflect.ValueOf(a.Annotations).UnsafePointer() != reflect.ValueOf(b.Annotations).UnsafePointer() {
		t.Error("equal annotations are two maps")
	}
	if reflect.ValueOf(a.Spec.Capacity).UnsafePointer() != reflect.ValueOf(b.Spec.Capacity).UnsafePointer() {
		t.Error("equal capacities are two maps")
	}
	if unsafe.StringData(a.Spec.CSI.VolumeHandle) == unsafe.StringData(b.Spec.CSI.VolumeHandle) && a.Spec.CSI.VolumeHandle != b.Spec.CSI.VolumeHandle {
		t.Error("volume handles mixed up")
	}
	// A map with content of its own is not replaced by another object's.
	c := samplePV(3)
	c.Annotations["only"] = "mine"
	c.Spec.Capacity[v1.ResourceStorage] = resource.MustParse("2Gi")
	out, _ := transform(c)
	if got := out.(*v1.PersistentVolume); got.Annotations["only"] != "mine" || got.Spec.Capacity.Storage().String() != "2Gi" {
		t.Errorf("an object's own annotation or capacity was lost: %v %v", got.Annotations, got.Spec.Capacity)
	}
}

func TestSharedMapsTableIsBounded(t *testing.T) {
	s := newSharedValues()
	for i := range maxSharedMaps + 10 {
		s.share(reflect.ValueOf(map[string]string{"k": fmt.Sprint(i)}))
	}
	if n := len(s.maps); n > maxSharedMaps {
		t.Errorf("%d maps kept, want at most %d", n, maxSharedMaps)
	}
	big := map[string]string{}
	for i := range maxSharedLength + 1 {
		big[fmt.Sprint(i)] = "v"
	}
	if got := s.share(reflect.ValueOf(big)); !reflect.DeepEqual(got.Interface(), big) {
		t.Errorf("a large map changed: %v", got)
	}
	if n := len(s.maps); n > maxSharedMaps {
		t.Errorf("a large map was kept in the table")
	}
	for i := range maxSharedStrings + 10 {
		if got, want := s.intern(fmt.Sprint(i)), fmt.Sprint(i); got != want {
			t.Fatalf("intern(%q) = %q", want, got)
		}
	}
	if n := len(s.strings); n > maxSharedStrings {
		t.Errorf("%d strings kept, want at most %d", n, maxSharedStrings)
	}
}

// An informer may pass one object through its transform twice (a watch list's objects go
// into a temporary store, and through the transform again as they enter the queue) while
// other informers transform objects that share its maps: a shared map is only ever read, so
// this neither races nor changes any object. (Run under -race by make test-race.)
func TestCacheTransformRepeatedWhileOthersRun(t *testing.T) {
	transform := NewTransform()
	const n = 200
	objs := make([]*v1.PersistentVolume, n)
	want := make([]*v1.PersistentVolume, n)
	for i := range n {
		pv := samplePV(i)
		pv.ManagedFields = nil
		want[i] = pv.DeepCopy()
		out, err := transform(pv)
		if err != nil {
			t.Fatal(err)
		}
		objs[i] = out.(*v1.PersistentVolume)
	}
	var wg sync.WaitGroup
	for part := range 2 { // again, each object by one goroutine, as an informer does
		wg.Go(func() {
			for _, o := range objs[part*n/2 : (part+1)*n/2] {
				_, _ = transform(o)
			}
		})
	}
	for range 2 { // fresh objects with the same maps, meanwhile
		wg.Go(func() {
			for i := range n {
				_, _ = transform(samplePV(i))
			}
		})
	}
	wg.Wait()
	for i := range n {
		if !reflect.DeepEqual(objs[i], want[i]) {
			t.Fatalf("object %d changed by the repeated transform:\n%+v\n%+v", i, objs[i], want[i])
		}
	}
}
