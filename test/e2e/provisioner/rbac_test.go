package provisioner

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// Upstream's verbs on volumesnapshots: v6.2 added watch and update (the source-protection
// finalizer); v6.0 and v6.1 grant get and list only.
var (
	snapshotVerbsV62 = []string{"get", "list", "watch", "update"}
	snapshotVerbsV60 = []string{"get", "list"}
)

// upstreamClusterRules is the ClusterRole external-provisioner-runner of
// external-provisioner v6.4.0's deploy/kubernetes/rbac.yaml, with the secrets rule
// uncommented as the file says to for drivers that use secrets, and the given verbs on
// volumesnapshots.
func upstreamClusterRules(snapshotVerbs []string) []rbacv1.PolicyRule {
	return []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "list"}},
		{APIGroups: []string{""}, Resources: []string{"persistentvolumes"}, Verbs: []string{"get", "list", "watch", "create", "patch", "delete"}},
		{APIGroups: []string{""}, Resources: []string{"persistentvolumeclaims"}, Verbs: []string{"get", "list", "watch", "update"}},
		{APIGroups: []string{"storage.k8s.io"}, Resources: []string{"storageclasses"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"list", "watch", "create", "update", "patch"}},
		{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshots"}, Verbs: snapshotVerbs},
		{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshotcontents"}, Verbs: []string{"get", "list"}},
		{APIGroups: []string{"storage.k8s.io"}, Resources: []string{"csinodes"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"storage.k8s.io"}, Resources: []string{"volumeattachments"}, Verbs: []string{"get", "list", "watch"}},
	}
}

// upstreamNamespaceRules is the Role external-provisioner-cfg of the same file.
var upstreamNamespaceRules = []rbacv1.PolicyRule{
	{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"get", "watch", "list", "delete", "update", "create"}},
	{APIGroups: []string{"storage.k8s.io"}, Resources: []string{"csistoragecapacities"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete"}},
	{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}},
	{APIGroups: []string{"apps"}, Resources: []string{"replicasets"}, Verbs: []string{"get"}},
}

// upstreamServiceAccount creates a ServiceAccount bound to upstream's provisioner RBAC
// (snapshotVerbs on volumesnapshots) and returns a kubeconfig with a token of it.
func (s *scenario) upstreamServiceAccount(snapshotVerbs []string) string {
	s.T.Helper()
	return s.KubeconfigWithRules("csi-provisioner", e2e.Rules{Cluster: upstreamClusterRules(snapshotVerbs), Namespace: upstreamNamespaceRules})
}

// deleteCalls returns the DeleteVolume calls of the journal for a volume.
func deleteCalls(calls []testdriver.Call, volumeID string) int {
	n := 0
	for _, c := range calls {
		if c.Method == testdriver.MethodDeleteVolume && c.VolumeID == volumeID {
			n++
		}
	}
	return n
}

// With exactly upstream's RBAC (v6.4.0), the provisioner deletes a released volume once
// and lets its PersistentVolume go, protects a snapshot while restoring from it, and hands
// a claim whose node ran out of space back to the scheduler; the API server refuses
// nothing it asks.
func TestWorksWithUpstreamsRBAC(t *testing.T) {
	s := newScenario(t, testdriver.Config{Topology: true, ControllerCapabilities: withCapabilities(csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)})
	snaps := installSnapshotCRDs(t, s)
	node := s.createNode("n1")
	fast := s.createClass("fast", nil)
	late := s.createClass("late", func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	})
	r := s.startReplica("replica-a", "--kubeconfig="+s.upstreamServiceAccount(snapshotVerbsV62))
	s.WaitForHolder(s.leaseName, "replica-a")
	r.WaitReady(t)
	ctx := s.ctx()

	// Deletion: the volume goes once, then the PersistentVolume is deleted and loses our
	// finalizer (the pv-protection one stays: no controller-manager runs to remove it).
	c := s.createClaim("data", fast.Name, "")
	pvName := "pvc-" + string(c.UID)
	s.WaitUntil("the PersistentVolume", func() bool { return s.pvs()[pvName] != nil })
	pv := s.pvs()[pvName]
	s.markReleased(pv)
	s.WaitUntil("the PersistentVolume deleted without our finalizer", func() bool {
		pv, err := s.Client.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
		return apierrors.IsNotFound(err) || err == nil && pv.DeletionTimestamp != nil && !slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer)
	})
	if _, ok := s.Driver.Volume(pv.Spec.CSI.VolumeHandle); ok {
		t.Errorf("volume %s is still in the driver", pv.Spec.CSI.VolumeHandle)
	}
	if n := deleteCalls(s.Driver.Journal(), pv.Spec.CSI.VolumeHandle); n != 1 {
		t.Errorf("%d DeleteVolume calls for %s, want 1", n, pv.Spec.CSI.VolumeHandle)
	}

	// Restore: the snapshot is protected while its volume is made, and let go after.
	srcHandle := s.provisionBoundSource("src", fast.Name)
	backend := s.createReadySnapshot(snaps, "snap", srcHandle)
	// Held in the driver until the finalizer has been seen on the snapshot.
	release := s.Driver.Hold(testdriver.MethodCreateVolume)
	t.Cleanup(release)
	restore := s.createClaimFrom("restore", fast.Name, v1.TypedLocalObjectReference{APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: "snap"})
	s.WaitUntil("the source-protection finalizer on the snapshot", func() bool {
		return slices.Contains(snapshotFinalizers(s, snaps, "snap"), snapshotFinalizer)
	})
	release()
	s.WaitUntil("the restored PersistentVolume", func() bool { return len(s.pvsByClaim()[restore.UID]) == 1 })
	s.WaitUntil("the source-protection finalizer gone", func() bool {
		return !slices.Contains(snapshotFinalizers(s, snaps, "snap"), snapshotFinalizer)
	})
	s.checkMadeFrom([]*v1.PersistentVolumeClaim{restore}, func(src *csi.VolumeContentSource) bool { return src.GetSnapshot().GetSnapshotId() == backend.ID })
	s.Driver.SetMethodLatency(testdriver.MethodCreateVolume, 0)

	// Reschedule: the next CreateVolume (this claim's: nothing else is pending) runs out
	// of space on the selected node.
	if err := s.Driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: codes.ResourceExhausted, Times: 1}); err != nil {
		t.Fatal(err)
	}
	s.createClaim("full", late.Name, node)
	s.WaitUntil("the selected node removed from the claim", func() bool {
		claim, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Get(ctx, "full", metav1.GetOptions{})
		_, selected := claim.Annotations[volumehelpers.AnnSelectedNode]
		return err == nil && !selected
	})

	e2e.NoForbidden(t, r) // the API server refused no request
}

// With upstream's RBAC before v6.2 (get and list on volumesnapshots), restores work
// without source protection, and the missing permissions are one warning each.
func TestRestoresWithUpstreamsRBACBeforeV62(t *testing.T) {
	s := newScenario(t, testdriver.Config{ControllerCapabilities: withCapabilities(csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)})
	snaps := installSnapshotCRDs(t, s)
	fast := s.createClass("fast", nil)
	r := s.startReplica("replica-a", "--kubeconfig="+s.upstreamServiceAccount(snapshotVerbsV60))
	s.WaitForHolder(s.leaseName, "replica-a")
	r.WaitReady(t)

	srcHandle := s.provisionBoundSource("src", fast.Name)
	backend := s.createReadySnapshot(snaps, "snap", srcHandle)
	var restores []*v1.PersistentVolumeClaim
	for i := range 2 {
		restores = append(restores, s.createClaimFrom(fmt.Sprintf("restore-%d", i), fast.Name,
			v1.TypedLocalObjectReference{APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: "snap"}))
	}
	s.waitForPVs(3)
	s.checkMadeFrom(restores, func(src *csi.VolumeContentSource) bool { return src.GetSnapshot().GetSnapshotId() == backend.ID })
	if f := snapshotFinalizers(s, snaps, "snap"); slices.Contains(f, snapshotFinalizer) {
		t.Errorf("snapshot finalizers %v: the update was not refused?", f)
	}
	log := r.Stderr()
	for _, permission := range []string{"update on volumesnapshots", "watch on volumesnapshots"} {
		if n := strings.Count(log, `missingPermission="`+permission); n != 1 {
			t.Errorf("%d warnings about %s, want 1:\n%s", n, permission, grepLines(log, "missingPermission"))
		}
	}
}

// grepLines returns the lines of log containing s.
func grepLines(log, s string) string {
	var out []string
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// Upstream's own RBAC is enough: with a token of a ServiceAccount that holds exactly
// upstream's rules, the provisioner provisions, clones, restores and deletes volumes (the
// Delete policy: the volume leaves the backend once and the PersistentVolume goes), and no
// request of it is refused.
func TestUpstreamRBACIsEnoughToProvisionCloneRestoreAndDelete(t *testing.T) {
	s := newScenario(t, testdriver.Config{ControllerCapabilities: withCapabilities(
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME, csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)})
	snaps := installSnapshotCRDs(t, s)
	fast := s.createClass("fast", nil)
	a := s.startReplica("replica-a", "--kubeconfig="+s.upstreamServiceAccount(snapshotVerbsV62))
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	srcHandle := s.provisionBoundSource("src", fast.Name)
	backend := s.createReadySnapshot(snaps, "snap", srcHandle)
	clone := s.createClaimFrom("clone", fast.Name, v1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "src"})
	restore := s.createClaimFrom("restore", fast.Name,
		v1.TypedLocalObjectReference{APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: "snap"})
	s.waitForPVs(3)
	s.checkMadeFrom([]*v1.PersistentVolumeClaim{clone}, func(src *csi.VolumeContentSource) bool { return src.GetVolume().GetVolumeId() == srcHandle })
	s.checkMadeFrom([]*v1.PersistentVolumeClaim{restore}, func(src *csi.VolumeContentSource) bool { return src.GetSnapshot().GetSnapshotId() == backend.ID })

	for _, pv := range s.pvs() {
		s.markReleased(pv)
	}
	s.WaitUntil("every volume deleted and its PersistentVolume let go", func() bool {
		for _, pv := range s.pvs() {
			if pv.DeletionTimestamp == nil || slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer) {
				return false
			}
		}
		return len(s.Driver.Volumes()) == 0
	})
	deletes := map[string]int{}
	for _, c := range s.Driver.Journal() {
		if c.Method == testdriver.MethodDeleteVolume && c.Code == "OK" {
			deletes[c.VolumeID]++
		}
	}
	for id, n := range deletes {
		if n != 1 {
			t.Errorf("volume %s: DeleteVolume succeeded %d times, want once", id, n)
		}
	}
	e2e.NoForbidden(t, a)
}
