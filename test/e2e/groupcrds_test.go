package e2e

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/snapshotcontroller"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/snapshotter"
)

// As csi-snapshotter v8.7.0, where CSIVolumeGroupSnapshot is GA and on: in a cluster with
// the VolumeSnapshot CRDs but not the VolumeGroupSnapshot ones (this package's control
// plane has no other snapshot CRDs), the snapshotter warns and carries on: it leads, stays
// up and takes snapshots.
func TestSnapshotterWithoutTheGroupSnapshotCRDsStillTakesSnapshots(t *testing.T) {
	t.Parallel()
	cp := kube.Get(t)
	ctx := context.Background()
	if err := snapshotcontroller.InstallVolumeSnapshotCRDs(ctx, cp.Config()); err != nil {
		t.Fatal(err)
	}
	s := e2e.NewScenario(t, cp, binDir, testdriver.Config{ControllerCapabilities: append(testdriver.DefaultControllerCapabilities(),
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT, csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS)})
	lease := lifecycle.SanitizeName(snapshotter.New().LeaseName(s.Driver.DriverName()))
	r := s.Start("snapshotter-a", []string{"csi-sidecars", "snapshotter"})
	s.WaitForHolder(lease, "snapshotter-a")
	r.WaitReady(t)

	vol, err := csi.NewControllerClient(testdriver.Dial(t, s.Driver)).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "source",
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}})
	if err != nil {
		t.Fatal(err)
	}
	snaps := snapclientset.NewForConfigOrDie(cp.Config())
	class := &snapv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: s.Namespace}, Driver: s.Driver.DriverName(), DeletionPolicy: snapv1.VolumeSnapshotContentDelete}
	if _, err := snaps.SnapshotV1().VolumeSnapshotClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = snaps.SnapshotV1().VolumeSnapshotClasses().Delete(context.Background(), class.Name, metav1.DeleteOptions{})
	})
	content := &snapv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: s.Namespace + "-content"}, Spec: snapv1.VolumeSnapshotContentSpec{
		Driver:                  s.Driver.DriverName(),
		DeletionPolicy:          snapv1.VolumeSnapshotContentDelete,
		VolumeSnapshotClassName: ptr.To(class.Name),
		Source:                  snapv1.VolumeSnapshotContentSource{VolumeHandle: ptr.To(vol.Volume.VolumeId)},
		VolumeSnapshotRef:       corev1.ObjectReference{Namespace: s.Namespace, Name: "snap", UID: "4d8e0a2c-0000-4000-8000-000000000001"},
	}}
	if _, err := snaps.SnapshotV1().VolumeSnapshotContents().Create(ctx, content, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = snaps.SnapshotV1().VolumeSnapshotContents().Delete(context.Background(), content.Name, metav1.DeleteOptions{})
	})
	s.WaitUntil("the content's snapshot taken and ready", func() bool {
		got, err := snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, content.Name, metav1.GetOptions{})
		return err == nil && got.Status != nil && ptr.Deref(got.Status.ReadyToUse, false) && ptr.Deref(got.Status.SnapshotHandle, "") != ""
	})
	if !r.Running() {
		t.Errorf("the snapshotter exited without the group snapshot CRDs")
	}
	if n := len(s.Driver.Calls(testdriver.MethodCreateSnapshot)); n != 1 {
		t.Errorf("%d CreateSnapshot calls, want 1", n)
	}
}
