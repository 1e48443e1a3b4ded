package provisioner

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// CSI migration: the test driver registered under the name of the CSI driver that replaces
// the in-tree kubernetes.io/aws-ebs plugin provisions a claim of an in-tree EBS
// StorageClass once kube-controller-manager hands it over (its part played by the test:
// the storage-provisioner and migrated-to annotations name the driver), with the class's
// parameters translated; the PersistentVolume is written in the in-tree form, provisioned
// by the in-tree plugin; once released, DeleteVolume gets the translated handle and the
// PersistentVolume goes. The calls' metrics say migrated="true", and upstream's RBAC is
// enough.
func TestMigratedInTreeClaimIsProvisionedAndDeleted(t *testing.T) {
	const (
		driver = "ebs.csi.aws.com"
		inTree = "kubernetes.io/aws-ebs"
	)
	s := newScenario(t, testdriver.Config{DriverName: driver})
	sc := &storagev1.StorageClass{
		ObjectMeta:    metav1.ObjectMeta{Name: s.name("gp3")},
		Provisioner:   inTree,
		ReclaimPolicy: ptr.To(v1.PersistentVolumeReclaimDelete),
		Parameters:    map[string]string{"type": "gp3", "fsType": "xfs", "iopsPerGB": "10"},
	}
	if _, err := s.Client.StorageV1().StorageClasses().Create(s.ctx(), sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	r := s.startReplica("replica-a", "--kubeconfig="+s.upstreamServiceAccount(snapshotVerbsV62))
	s.WaitForHolder(s.leaseName, "replica-a")
	r.WaitReady(t)

	claim := s.createClaimAnnotated("data", sc.Name, "", map[string]string{volumehelpers.AnnMigratedTo: driver})
	pvName := "pvc-" + string(claim.UID)
	var pv *v1.PersistentVolume
	s.WaitUntil("the in-tree PersistentVolume", func() bool {
		got, err := s.Client.CoreV1().PersistentVolumes().Get(s.ctx(), pvName, metav1.GetOptions{})
		pv = got
		return err == nil
	})
	vols := s.Driver.Volumes()
	if len(vols) != 1 || vols[0].Name != pvName {
		t.Fatalf("driver volumes %+v, want %s", vols, pvName)
	}
	vol := vols[0]
	if diff := cmp.Diff(map[string]string{"type": "gp3", "iopsPerGB": "10", "allowautoiopspergbincrease": "true"}, vol.Parameters); diff != "" {
		t.Errorf("CreateVolume parameters (-want +got):\n%s", diff)
	}
	if pv.Spec.CSI != nil || pv.Spec.AWSElasticBlockStore == nil || pv.Spec.AWSElasticBlockStore.VolumeID != vol.ID || pv.Spec.AWSElasticBlockStore.FSType != "xfs" {
		t.Fatalf("PV source %+v, want awsElasticBlockStore %s (xfs)", pv.Spec.PersistentVolumeSource, vol.ID)
	}
	if by := pv.Annotations[volumehelpers.AnnDynamicallyProvisioned]; by != inTree {
		t.Errorf("provisioned-by %q, want %q", by, inTree)
	}
	if pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.UID != claim.UID || pv.Spec.StorageClassName != sc.Name {
		t.Errorf("PV claimRef %+v, class %q: want the claim and its class", pv.Spec.ClaimRef, pv.Spec.StorageClassName)
	}

	// kube-controller-manager marks the volume migrated and, the claim gone, releases it.
	if err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Delete(s.ctx(), claim.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	pv.Annotations[volumehelpers.AnnMigratedTo] = driver
	pv, err := s.Client.CoreV1().PersistentVolumes().Update(s.ctx(), pv, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	s.markReleased(pv)
	s.WaitUntil("the PersistentVolume deleted without our finalizer", func() bool {
		got, err := s.Client.CoreV1().PersistentVolumes().Get(s.ctx(), pvName, metav1.GetOptions{})
		return apierrors.IsNotFound(err) || err == nil && got.DeletionTimestamp != nil && !strings.Contains(strings.Join(got.Finalizers, ","), volumehelpers.PVDeletionProtectionFinalizer)
	})
	if _, ok := s.Driver.Volume(vol.ID); ok {
		t.Errorf("volume %s is still in the driver", vol.ID)
	}
	if n := deleteCalls(s.Driver.Journal(), vol.ID); n != 1 {
		t.Errorf("%d DeleteVolume calls for %s, want 1", n, vol.ID)
	}

	_, metrics := r.Get("/metrics")
	for _, method := range []string{"CreateVolume", "DeleteVolume"} {
		found := false
		for _, line := range strings.Split(metrics, "\n") {
			if strings.HasPrefix(line, "csi_sidecar_operations_seconds_count{") && strings.Contains(line, `method_name="/csi.v1.Controller/`+method+`"`) {
				found = true
				if !strings.Contains(line, `migrated="true"`) {
					t.Errorf("metrics %q, want migrated=\"true\"", line)
				}
			}
		}
		if !found {
			t.Errorf("no %s metrics", method)
		}
	}
	e2e.NoForbidden(t, r) // the API server refused no request
}
