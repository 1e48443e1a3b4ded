package provisioner

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testdriver"
)

func TestAClonePutsTheCloningFinalizerOnItsSourceUntilItsVolumeIsRecorded(t *testing.T) {
	caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CLONE_VOLUME)
	src, srcPV := boundSource()
	src.Namespace = "ns"
	dst := claimFor("dst", "uid-dst", "fast")
	dst.Namespace = "ns"
	dst.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: pvcKind, Name: "src"}
	w := newWorld(t, testdriver.Config{ControllerCapabilities: caps}, nil, class("fast", nil), src)
	srcPV.Spec.CSI.VolumeHandle = w.sourceVolume()
	w.create(srcPV, dst)

	w.waitFor("the clone's PersistentVolume", func() bool { return w.pv("pvc-uid-dst") != nil })
	calls := w.calls(testdriver.MethodCreateVolume) // the source's and the clone's
	if len(calls) != 2 {
		t.Fatalf("CreateVolume calls %+v, want 2", calls)
	}
	vol, _ := w.driver.Volume(calls[1].VolumeID)
	if vol.ContentSource.GetVolume().GetVolumeId() != srcPV.Spec.CSI.VolumeHandle {
		t.Errorf("volume made from %v, want a clone of vol-src", vol.ContentSource)
	}
	w.waitFor("the cloning finalizer gone", func() bool {
		c, err := w.kube.CoreV1().PersistentVolumeClaims("ns").Get(context.Background(), "src", metav1.GetOptions{})
		return err == nil && !slices.Contains(c.Finalizers, cloneProtectionFinalizer)
	})
	// It was there while the volume was made: the first update of the source adds it.
	var added, removed bool
	for _, a := range w.kube.Actions() {
		u, ok := a.(k8stesting.UpdateAction)
		if !ok || a.GetResource().Resource != "persistentvolumeclaims" {
			continue
		}
		c := u.GetObject().(*v1.PersistentVolumeClaim)
		if c.Name != "src" {
			continue
		}
		has := slices.Contains(c.Finalizers, cloneProtectionFinalizer)
		if has && !removed {
			added = true
		} else if !has && added {
			removed = true
		}
	}
	if !added || !removed {
		t.Errorf("source updates: finalizer added %v, then removed %v", added, removed)
	}
}

func TestACloneIsRefusedWithoutCloneVolume(t *testing.T) {
	src, srcPV := boundSource()
	dst := claimFor("dst", "uid-dst", "fast")
	dst.Namespace = "ns"
	dst.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: pvcKind, Name: "src"}
	w := newWorld(t, testdriver.Config{}, nil, class("fast", nil), src, srcPV, dst)
	w.waitFor("a ProvisioningFailed event naming CLONE_VOLUME", func() bool {
		return slices.ContainsFunc(w.events(), func(e string) bool { return strings.Contains(e, "CLONE_VOLUME") })
	})
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 0 {
		t.Errorf("%d CreateVolume calls, want none", n)
	}
}

// sourceVolume creates a volume in the driver, as if an earlier claim had been provisioned.
func (w *world) sourceVolume() string {
	w.t.Helper()
	rsp, err := w.ctrl.csi.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "source", VolumeCapabilities: []*csi.VolumeCapability{{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}}})
	if err != nil {
		w.t.Fatal(err)
	}
	return rsp.GetVolume().GetVolumeId()
}

// create creates claims and PersistentVolumes in the fake API server.
func (w *world) create(objs ...any) {
	w.t.Helper()
	ctx := context.Background()
	for _, o := range objs {
		var err error
		switch o := o.(type) {
		case *v1.PersistentVolumeClaim:
			_, err = w.kube.CoreV1().PersistentVolumeClaims(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *v1.PersistentVolume:
			_, err = w.kube.CoreV1().PersistentVolumes().Create(ctx, o, metav1.CreateOptions{})
		}
		if err != nil {
			w.t.Fatal(err)
		}
	}
}

func TestTheOrphanSweepRemovesASnapshotFinalizerNoClaimNeedsAndKeepsOneThatIsNeeded(t *testing.T) {
	caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)
	orphan := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "orphan", Namespace: "ns", Finalizers: []string{snapshotProtectionFinalizer, "other"}}}
	needed := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "needed", Namespace: "ns", Finalizers: []string{snapshotProtectionFinalizer}}}
	// A claim of the driver still waiting for its restore (not ready: no content yet).
	waiting := claimFor("waiting", "uid-waiting", "fast")
	waiting.Namespace = "ns"
	waiting.Spec.DataSource = &v1.TypedLocalObjectReference{APIGroup: ptr.To(snapshotAPIGroup), Kind: snapshotKind, Name: "needed"}
	snaps := snapfake.NewSimpleClientset(orphan, needed)
	w := newWorld(t, testdriver.Config{ControllerCapabilities: caps}, func(c *config) {
		c.snapshotClient = noWatchList{snaps}
		c.opts.snapshotOrphanSweepInterval = 50 * time.Millisecond
	}, class("fast", nil), waiting)

	finalizers := func(name string) []string {
		s, err := snaps.SnapshotV1().VolumeSnapshots("ns").Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return s.Finalizers
	}
	w.waitFor("the orphaned finalizer removed", func() bool {
		return !slices.Contains(finalizers("orphan"), snapshotProtectionFinalizer)
	})
	if got := finalizers("orphan"); !slices.Equal(got, []string{"other"}) {
		t.Errorf("orphan's finalizers %v, want only the other one", got)
	}
	if !slices.Contains(finalizers("needed"), snapshotProtectionFinalizer) {
		t.Errorf("the finalizer of a snapshot a pending claim restores was removed")
	}
}

// noWatchList tells client-go's informers that the generated snapshot fake cannot stream
// lists (it predates watch-list); they then list and watch as before.
type noWatchList struct{ *snapfake.Clientset }

func (noWatchList) IsWatchListSemanticsUnSupported() bool { return true }
