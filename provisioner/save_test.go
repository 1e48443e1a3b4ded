package provisioner

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

func TestBuildPVRecordsTheVolumeForTheClaim(t *testing.T) {
	claim := claimWith("1Gi", v1.ReadWriteOnce)
	claim.ResourceVersion = "7"
	claim.Spec.StorageClassName = ptr.To("fast")
	claim.Spec.VolumeMode = ptr.To(v1.PersistentVolumeFilesystem)
	class := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "fast"}, MountOptions: []string{"noatime"}}
	ref := func(n string) *v1.SecretReference { return &v1.SecretReference{Name: n, Namespace: "ns"} }
	in := pvInput{
		name: "pvc-1", driver: drv, claim: claim, class: class, fsType: "xfs", identity: "id-1", topology: true, vac: "gold",
		requestedBytes: 1 << 30,
		secrets: request.SecretRefs{Provisioner: ref("prov"), ControllerPublish: ref("cp"), NodeStage: ref("ns"),
			NodePublish: ref("np"), ControllerExpand: ref("ce"), NodeExpand: ref("ne"), ControllerModify: ref("cm")},
		volume: &csi.Volume{VolumeId: "vol-1", CapacityBytes: 2 << 30, VolumeContext: map[string]string{"k": "v"},
			AccessibleTopology: []*csi.Topology{topo(zoneKey, "z1")}},
	}
	got, err := buildPV(in)
	if err != nil {
		t.Fatal(err)
	}
	want := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name: "pvc-1",
			Annotations: map[string]string{
				volumehelpers.AnnDynamicallyProvisioned: drv,
				request.AnnDeletionSecretName:           "prov",
				request.AnnDeletionSecretNamespace:      "ns",
				request.AnnModifySecretName:             "cm",
				request.AnnModifySecretNamespace:        "ns",
			},
			Finalizers: []string{volumehelpers.PVDeletionProtectionFinalizer},
		},
		Spec: v1.PersistentVolumeSpec{
			AccessModes:  []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			MountOptions: []string{"noatime"},
			Capacity:     v1.ResourceList{v1.ResourceStorage: *resource.NewQuantity(2<<30, resource.BinarySI)},
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
				Driver: drv, VolumeHandle: "vol-1", FSType: "xfs",
				VolumeAttributes:           map[string]string{request.ProvisionerIDKey: "id-1", "k": "v"},
				ControllerPublishSecretRef: ref("cp"), NodeStageSecretRef: ref("ns"), NodePublishSecretRef: ref("np"),
				ControllerExpandSecretRef: ref("ce"), NodeExpandSecretRef: ref("ne"),
			}},
			PersistentVolumeReclaimPolicy: v1.PersistentVolumeReclaimDelete,
			StorageClassName:              "fast",
			VolumeMode:                    ptr.To(v1.PersistentVolumeFilesystem),
			ClaimRef:                      &v1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: "ns", Name: "data", UID: testUID, ResourceVersion: "7"},
			NodeAffinity:                  request.NodeAffinity([]*csi.Topology{topo(zoneKey, "z1")}),
			VolumeAttributesClassName:     ptr.To("gold"),
		},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("PV (-want +got):\n%s", diff)
	}
}

func TestBuildPVVariants(t *testing.T) {
	base := func() pvInput {
		return pvInput{name: "pvc-1", driver: drv, claim: claimWith("1Gi", v1.ReadOnlyMany),
			class: &storagev1.StorageClass{}, fsType: "ext4", requestedBytes: 1 << 30, volume: &csi.Volume{VolumeId: "v"}}
	}
	t.Run("Retain gets no finalizer, empty deletion-secret annotations", func(t *testing.T) {
		in := base()
		in.class.ReclaimPolicy = ptr.To(v1.PersistentVolumeReclaimRetain)
		pv, err := buildPV(in)
		if err != nil {
			t.Fatal(err)
		}
		if len(pv.Finalizers) != 0 || pv.Spec.PersistentVolumeReclaimPolicy != v1.PersistentVolumeReclaimRetain {
			t.Errorf("finalizers %v, policy %s", pv.Finalizers, pv.Spec.PersistentVolumeReclaimPolicy)
		}
		if v, ok := pv.Annotations[request.AnnDeletionSecretName]; !ok || v != "" {
			t.Errorf("deletion secret name annotation %q (present %v), want present and empty", v, ok)
		}
		// Upstream writes the modify-secret annotations only for a class naming the secret.
		if _, ok := pv.Annotations[request.AnnModifySecretName]; ok {
			t.Errorf("modify secret annotation without a modify secret: %v", pv.Annotations)
		}
	})
	t.Run("block has no fsType, no topology gives no affinity, unknown size records the request", func(t *testing.T) {
		in := base()
		in.claim.Spec.VolumeMode = ptr.To(v1.PersistentVolumeBlock)
		in.volume.AccessibleTopology = []*csi.Topology{topo(zoneKey, "z1")}
		pv, err := buildPV(in)
		if err != nil {
			t.Fatal(err)
		}
		q := pv.Spec.Capacity[v1.ResourceStorage]
		if pv.Spec.CSI.FSType != "" || pv.Spec.NodeAffinity != nil || q.Value() != 1<<30 {
			t.Errorf("fsType %q, affinity %v, capacity %s", pv.Spec.CSI.FSType, pv.Spec.NodeAffinity, q.String())
		}
	})
	t.Run("smaller than requested is an error", func(t *testing.T) {
		in := base()
		in.volume.CapacityBytes = 1
		if _, err := buildPV(in); err == nil {
			t.Error("no error for a volume smaller than the claim")
		}
	})
	t.Run("read-only only for a single ROX mode with the flag", func(t *testing.T) {
		rox := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY}}
		rwx := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER}}
		for _, tc := range []struct {
			caps []*csi.VolumeCapability
			flag bool
			want bool
		}{{[]*csi.VolumeCapability{rox}, true, true}, {[]*csi.VolumeCapability{rox}, false, false}, {[]*csi.VolumeCapability{rox, rwx}, true, false}} {
			if got := readOnlyPV(tc.caps, tc.flag); got != tc.want {
				t.Errorf("%d caps, flag %v: read-only %v, want %v", len(tc.caps), tc.flag, got, tc.want)
			}
		}
	})
}
