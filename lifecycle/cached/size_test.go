package cached

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// Objects as a CSI driver's cluster holds them: a provisioned, bound PV and its claim, an
// attached VolumeAttachment.
func samplePV(i int) *v1.PersistentVolume {
	now := metav1.NewTime(time.Now())
	return &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("pvc-%08d-aaaa-bbbb-cccc-dddddddddddd", i), UID: "3f1a1b2c-1234-4321-abcd-123456789012", ResourceVersion: fmt.Sprint(100000 + i), CreationTimestamp: now,
			Annotations: map[string]string{"pv.kubernetes.io/provisioned-by": "hostpath.csi.k8s.io", "volume.kubernetes.io/provisioner-deletion-secret-name": "", "volume.kubernetes.io/provisioner-deletion-secret-namespace": ""},
			Finalizers:  []string{"kubernetes.io/pv-protection", "external-attacher/hostpath-csi-k8s-io"},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "csi-provisioner", Operation: metav1.ManagedFieldsOperationUpdate, APIVersion: "v1", Time: &now, FieldsType: "FieldsV1",
				FieldsV1: &metav1.FieldsV1{Raw: []byte(`{"f:metadata":{"f:annotations":{".":{},"f:pv.kubernetes.io/provisioned-by":{}}},"f:spec":{"f:accessModes":{},"f:capacity":{".":{},"f:storage":{}},"f:claimRef":{},"f:csi":{}}}`)}}},
		},
		Spec: v1.PersistentVolumeSpec{
			AccessModes: []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			Capacity:    v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")},
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
				Driver: "hostpath.csi.k8s.io", VolumeHandle: fmt.Sprintf("%08d-8f3e-11ee-b9d1-0242ac120002", i), FSType: "ext4",
				VolumeAttributes: map[string]string{"storage.kubernetes.io/csiProvisionerIdentity": "1752000000000-1234-hostpath.csi.k8s.io"},
			}},
			PersistentVolumeReclaimPolicy: v1.PersistentVolumeReclaimDelete,
			StorageClassName:              "csi-hostpath-sc",
			VolumeMode:                    ptr.To(v1.PersistentVolumeFilesystem),
			ClaimRef: &v1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: "default", Name: fmt.Sprintf("data-%05d", i),
				UID: "7a1a1b2c-1234-4321-abcd-123456789012", ResourceVersion: fmt.Sprint(90000 + i)},
			NodeAffinity: &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{
				{Key: "topology.hostpath.csi/node", Operator: v1.NodeSelectorOpIn, Values: []string{fmt.Sprintf("node-%d", i%10)}}}}}}},
		},
		Status: v1.PersistentVolumeStatus{Phase: v1.VolumeBound, LastPhaseTransitionTime: &now},
	}
}

func samplePVC(i int) *v1.PersistentVolumeClaim {
	size := resource.MustParse("1Gi")
	return &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("data-%05d", i), Namespace: "default", UID: "7a1a1b2c-1234-4321-abcd-123456789012", ResourceVersion: fmt.Sprint(90000 + i), CreationTimestamp: metav1.Now(),
			Annotations: map[string]string{"pv.kubernetes.io/bind-completed": "yes", "pv.kubernetes.io/bound-by-controller": "yes",
				"volume.beta.kubernetes.io/storage-provisioner": "hostpath.csi.k8s.io", "volume.kubernetes.io/storage-provisioner": "hostpath.csi.k8s.io"},
			Finalizers: []string{"kubernetes.io/pvc-protection"}},
		Spec: v1.PersistentVolumeClaimSpec{AccessModes: []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce}, StorageClassName: ptr.To("csi-hostpath-sc"),
			VolumeMode: ptr.To(v1.PersistentVolumeFilesystem), VolumeName: samplePV(i).Name, Resources: v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: size}}},
		Status: v1.PersistentVolumeClaimStatus{Phase: v1.ClaimBound, AccessModes: []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce}, Capacity: v1.ResourceList{v1.ResourceStorage: size}},
	}
}

func sampleVA(i int) *storagev1.VolumeAttachment {
	pv := samplePV(i).Name
	return &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("csi-%060d", i), UID: "5b1a1b2c-1234-4321-abcd-123456789012", ResourceVersion: fmt.Sprint(110000 + i), CreationTimestamp: metav1.Now(),
			Annotations: map[string]string{"csi.alpha.kubernetes.io/node-id": fmt.Sprintf("node-%d", i%10)}, Finalizers: []string{"external-attacher/hostpath-csi-k8s-io"}},
		Spec:   storagev1.VolumeAttachmentSpec{Attacher: "hostpath.csi.k8s.io", NodeName: fmt.Sprintf("node-%d", i%10), Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pv}},
		Status: storagev1.VolumeAttachmentStatus{Attached: true},
	}
}

// protoObject is a built-in type as the API server sends it: protobuf.
type protoObject interface {
	Marshal() ([]byte, error)
	Unmarshal([]byte) error
}

// cachedBytes is the heap each of n objects made by sample takes once decoded from
// protobuf and passed through transform, as an informer's cache keeps it.
func cachedBytes(t testing.TB, n int, sample func(int) protoObject, empty func() protoObject, transform func(any) (any, error)) float64 {
	t.Helper()
	wire := make([][]byte, n)
	for i := range n {
		b, err := sample(i).Marshal()
		if err != nil {
			t.Fatal(err)
		}
		wire[i] = b
	}
	kept := make([]any, n)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range n {
		obj := empty()
		if err := obj.Unmarshal(wire[i]); err != nil {
			t.Fatal(err)
		}
		out, err := transform(obj)
		if err != nil {
			t.Fatal(err)
		}
		kept[i] = out
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(kept)
	runtime.KeepAlive(wire) // not freed between the two readings
	return float64(after.HeapAlloc-before.HeapAlloc) / float64(n)
}

// BenchmarkCachedObjectBytes prints what one cached PV, claim and VolumeAttachment cost:
// as decoded, as Trim keeps them (managedFields dropped, repeated strings shared),
// and as a process's caches keep them (NewTransform: equal maps shared too).
func BenchmarkCachedObjectBytes(b *testing.B) {
	const n = 2500
	asIs := func(obj any) (any, error) { return obj, nil }
	kinds := []struct {
		name   string
		sample func(int) protoObject
		empty  func() protoObject
	}{
		{"PV", func(i int) protoObject { return samplePV(i) }, func() protoObject { return &v1.PersistentVolume{} }},
		{"PVC", func(i int) protoObject { return samplePVC(i) }, func() protoObject { return &v1.PersistentVolumeClaim{} }},
		{"VolumeAttachment", func(i int) protoObject { return sampleVA(i) }, func() protoObject { return &storagev1.VolumeAttachment{} }},
	}
	for range b.N {
		for _, k := range kinds {
			decoded := cachedBytes(b, n, k.sample, k.empty, asIs)
			trimmed := cachedBytes(b, n, k.sample, k.empty, Trim)
			shared := cachedBytes(b, n, k.sample, k.empty, NewTransform())
			b.ReportMetric(decoded, k.name+"-decoded-B")
			b.ReportMetric(trimmed, k.name+"-trimmed-B")
			b.ReportMetric(shared, k.name+"-cached-B")
		}
	}
}
