package provisioner

import (
	"context"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// The CSI driver csi-translation-lib migrates the in-tree kubernetes.io/aws-ebs plugin to.
const (
	ebsDriver = "ebs.csi.aws.com"
	ebsInTree = "kubernetes.io/aws-ebs"
)

// A claim of an in-tree class is the driver's once kube-controller-manager hands it over,
// as upstream decides: the provisioner annotation names the driver, or the in-tree plugin
// with migrated-to naming the driver.
func TestClaimsOfMigratedInTreeClassesAreTheDriversOnceHandedOver(t *testing.T) {
	ebs := request.NamesOf(ebsDriver)
	inTreeClass := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "sc"}, Provisioner: ebsInTree}
	csiClass := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "sc"}, Provisioner: ebsDriver}
	otherInTree := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "sc"}, Provisioner: "kubernetes.io/gce-pd"}
	claim := func(annotations ...string) *v1.PersistentVolumeClaim {
		c := claimWith("1Gi", v1.ReadWriteOnce)
		c.Annotations = map[string]string{}
		for i := 0; i+1 < len(annotations); i += 2 {
			c.Annotations[annotations[i]] = annotations[i+1]
		}
		return c
	}
	provisioner, migratedTo := volumehelpers.AnnStorageProvisioner, volumehelpers.AnnMigratedTo
	for _, tc := range []struct {
		name  string
		names request.DriverNames
		claim *v1.PersistentVolumeClaim
		class *storagev1.StorageClass
		want  bool
	}{
		{"handed over: provisioner names the driver", ebs, claim(provisioner, ebsDriver, migratedTo, ebsDriver), inTreeClass, true},
		{"handed over: the driver without migrated-to", ebs, claim(provisioner, ebsDriver), inTreeClass, true},
		{"handed over: the beta annotation", ebs, claim(volumehelpers.AnnBetaStorageProvisioner, ebsDriver), inTreeClass, true},
		{"handed over: the in-tree name, migrated to the driver", ebs, claim(provisioner, ebsInTree, migratedTo, ebsDriver), inTreeClass, true},
		{"not handed over: the in-tree name alone", ebs, claim(provisioner, ebsInTree), inTreeClass, false},
		{"not handed over: migrated to another driver", ebs, claim(provisioner, ebsInTree, migratedTo, "pd.csi.storage.gke.io"), inTreeClass, false},
		{"a CSI class of the driver still works", ebs, claim(provisioner, ebsDriver), csiClass, true},
		{"a class of another in-tree plugin", ebs, claim(provisioner, ebsDriver), otherInTree, false},
		{"a driver that replaces no plugin", request.DriverNames{Driver: drv}, claim(provisioner, drv), &storagev1.StorageClass{Provisioner: ebsInTree}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got, why := wantsVolume(tc.claim, tc.class, tc.names); got != tc.want {
				t.Errorf("wants %v (%s), want %v", got, why, tc.want)
			}
			if got := mayNeedVolume(tc.claim, tc.names); tc.want && !got {
				t.Error("the informer handler would not enqueue it")
			}
		})
	}
}

// The PersistentVolume of a migrated volume is written in the in-tree form upstream
// writes: an awsElasticBlockStore source with the driver's volume ID, provisioned by the
// in-tree plugin, protected by the same finalizer.
func TestBuildPVOfAMigratedClassIsInTree(t *testing.T) {
	claim := claimWith("1Gi", v1.ReadWriteOnce)
	claim.Spec.StorageClassName = ptr.To("ebs")
	in := pvInput{
		name: "pvc-1", driver: ebsDriver, claim: claim, fsType: "ext4", identity: "id-1", requestedBytes: 1 << 30, migrated: true,
		class:   &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "ebs"}, Provisioner: ebsInTree},
		secrets: request.SecretRefs{Provisioner: &v1.SecretReference{Name: "prov", Namespace: "ns"}},
		volume:  &csi.Volume{VolumeId: "vol-0123"},
	}
	pv, err := buildPV(in)
	if err != nil {
		t.Fatal(err)
	}
	if pv.Spec.CSI != nil {
		t.Errorf("CSI source %+v, want none", pv.Spec.CSI)
	}
	if diff := cmp.Diff(&v1.AWSElasticBlockStoreVolumeSource{VolumeID: "vol-0123", FSType: "ext4"}, pv.Spec.AWSElasticBlockStore); diff != "" {
		t.Errorf("in-tree source (-want +got):\n%s", diff)
	}
	if got := pv.Annotations[volumehelpers.AnnDynamicallyProvisioned]; got != ebsInTree {
		t.Errorf("provisioned-by %q, want %q", got, ebsInTree)
	}
	if pv.Annotations[request.AnnDeletionSecretName] != "prov" || !slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer) ||
		pv.Spec.StorageClassName != "ebs" || pv.Spec.ClaimRef == nil {
		t.Errorf("PV %+v lacks what deletion and binding need", pv)
	}
	// And back: what deletion translates it to is the driver's volume.
	vol, migrated, err := request.CSIVolume(pv)
	if err != nil || !migrated || vol.Spec.CSI.Driver != ebsDriver || vol.Spec.CSI.VolumeHandle != "vol-0123" {
		t.Errorf("translated back to %+v (migrated %v, err %v)", vol.Spec.CSI, migrated, err)
	}
}

// A claim of an in-tree EBS class handed over to the driver is provisioned through it with
// the class's parameters translated, recorded as an in-tree PersistentVolume, and deleted
// through it with the translated handle once released.
func TestAMigratedClaimIsProvisionedAndItsVolumeDeletedThroughTheDriver(t *testing.T) {
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "gp3"}, Provisioner: ebsInTree,
		ReclaimPolicy: ptr.To(v1.PersistentVolumeReclaimDelete),
		Parameters:    map[string]string{"type": "gp3", "fsType": "xfs", "iopsPerGB": "10"}}
	claim := claimFor("data", "uid-1", "gp3")
	claim.Annotations = map[string]string{volumehelpers.AnnStorageProvisioner: ebsDriver, volumehelpers.AnnMigratedTo: ebsDriver}
	w := newWorld(t, testdriver.Config{DriverName: ebsDriver}, nil, sc, claim)
	ctx := context.Background()

	claims := w.kube.CoreV1().PersistentVolumeClaims("ns")
	w.waitFor("the PersistentVolume, and the record closed", func() bool { return w.pv("pvc-uid-1") != nil && w.record("uid-1") == nil })
	vols := w.driver.Volumes()
	if len(vols) != 1 || vols[0].Name != "pvc-uid-1" {
		t.Fatalf("driver volumes %+v, want pvc-uid-1", vols)
	}
	id := vols[0].ID
	vol := vols[0]
	// The in-tree fsType went to the capability, iopsPerGB brought its companion.
	if diff := cmp.Diff(map[string]string{"type": "gp3", "iopsPerGB": "10", "allowautoiopspergbincrease": "true"}, vol.Parameters); diff != "" {
		t.Errorf("driver parameters (-want +got):\n%s", diff)
	}
	pv := w.pv("pvc-uid-1")
	if pv.Spec.CSI != nil || pv.Spec.AWSElasticBlockStore == nil || pv.Spec.AWSElasticBlockStore.VolumeID != id || pv.Spec.AWSElasticBlockStore.FSType != "xfs" {
		t.Fatalf("PV source %+v, want awsElasticBlockStore %s (xfs)", pv.Spec.PersistentVolumeSource, id)
	}
	if pv.Annotations[volumehelpers.AnnDynamicallyProvisioned] != ebsInTree {
		t.Errorf("provisioned-by %q, want %q", pv.Annotations[volumehelpers.AnnDynamicallyProvisioned], ebsInTree)
	}

	// The user deletes the claim; kube-controller-manager has marked the volume migrated,
	// and releases it.
	if err := claims.Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	pv.Annotations[volumehelpers.AnnMigratedTo] = ebsDriver
	if pv, err := w.kube.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	} else {
		pv.Status.Phase = v1.VolumeReleased
		if _, err := w.kube.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	w.waitFor("the PersistentVolume gone", func() bool {
		_, err := w.kube.CoreV1().PersistentVolumes().Get(ctx, "pvc-uid-1", metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	if _, ok := w.driver.Volume(id); ok {
		t.Error("the volume is still in the driver")
	}
	if deletes := w.calls(testdriver.MethodDeleteVolume); len(deletes) != 1 || deletes[0].VolumeID != id {
		t.Errorf("DeleteVolume calls %+v, want one for %s", deletes, id)
	}
}
