package provisioner

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

func TestAClonePutsTheCloningFinalizerOnItsSourceUntilItsVolumeIsRecorded(t *testing.T) {
	caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CLONE_VOLUME)
	src, srcPV := boundSource()
	src.Namespace = "ns"
	dst := claimFor("dst", "uid-dst", "fast")
	dst.Namespace = "ns"
	dst.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: request.PVCKind, Name: "src"}
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
		return err == nil && !slices.Contains(c.Finalizers, request.CloneProtectionFinalizer)
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
		has := slices.Contains(c.Finalizers, request.CloneProtectionFinalizer)
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
	dst.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: request.PVCKind, Name: "src"}
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

// create creates claims, PersistentVolumes and events in the fake API server.
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
		case *v1.Event:
			_, err = w.kube.CoreV1().Events(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		}
		if err != nil {
			w.t.Fatal(err)
		}
	}
}

func TestTheOrphanSweepRemovesASnapshotFinalizerNoClaimNeedsAndKeepsOneThatIsNeeded(t *testing.T) {
	caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)
	orphan, orphanContent := snapshotOf("orphan", drv, request.SnapshotProtectionFinalizer, "other")
	needed, neededContent := snapshotOf("needed", drv, request.SnapshotProtectionFinalizer)
	// Another driver's snapshot, protected by its provisioner (the finalizer name is
	// shared): this provisioner must leave it alone even though none of its claims uses it.
	foreign, foreignContent := snapshotOf("foreign", "other.csi.test", request.SnapshotProtectionFinalizer)
	// A claim of the driver still waiting for its restore.
	waiting := claimFor("waiting", "uid-waiting", "fast")
	waiting.Namespace = "ns"
	waiting.Spec.DataSource = &v1.TypedLocalObjectReference{APIGroup: ptr.To(request.SnapshotAPIGroup), Kind: request.SnapshotKind, Name: "needed"}
	snaps := snapfake.NewSimpleClientset(orphan, orphanContent, needed, neededContent, foreign, foreignContent)
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
		return !slices.Contains(finalizers("orphan"), request.SnapshotProtectionFinalizer)
	})
	if got := finalizers("orphan"); !slices.Equal(got, []string{"other"}) {
		t.Errorf("orphan's finalizers %v, want only the other one", got)
	}
	// The sweep runs every 50ms: a later orphan removed means the foreign one was seen.
	late, lateContent := snapshotOf("late", drv, request.SnapshotProtectionFinalizer)
	if _, err := snaps.SnapshotV1().VolumeSnapshotContents().Create(context.Background(), lateContent, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := snaps.SnapshotV1().VolumeSnapshots("ns").Create(context.Background(), late, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the later orphan's finalizer removed", func() bool {
		return !slices.Contains(finalizers("late"), request.SnapshotProtectionFinalizer)
	})
	if !slices.Contains(finalizers("needed"), request.SnapshotProtectionFinalizer) {
		t.Errorf("the finalizer of a snapshot a pending claim restores was removed")
	}
	if !slices.Contains(finalizers("foreign"), request.SnapshotProtectionFinalizer) {
		t.Errorf("the finalizer of another driver's snapshot was removed")
	}
}

// snapshotOf is a ready snapshot in namespace ns bound to a content of driver.
func snapshotOf(name, driver string, finalizers ...string) (*snapshotv1.VolumeSnapshot, *snapshotv1.VolumeSnapshotContent) {
	contentName := "content-" + name
	snap := &snapshotv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", Finalizers: finalizers},
		Status:     &snapshotv1.VolumeSnapshotStatus{BoundVolumeSnapshotContentName: ptr.To(contentName), ReadyToUse: ptr.To(true)},
	}
	content := &snapshotv1.VolumeSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{Name: contentName},
		Spec: snapshotv1.VolumeSnapshotContentSpec{Driver: driver, Source: snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: ptr.To("snap-" + name)},
			VolumeSnapshotRef: v1.ObjectReference{Name: name, Namespace: "ns"}},
	}
	return snap, content
}

func TestTheCloningFinalizerOfAnotherDriversClaimIsLeftAlone(t *testing.T) {
	// Claims carrying the cloning finalizer that no clone of this driver needs: one of
	// this driver (removed), one whose volume is another driver's (kept).
	ours, oursPV := boundSource()
	ours.Namespace, ours.Finalizers = "ns", []string{request.CloneProtectionFinalizer}
	foreign := claimFor("foreign", "uid-foreign", "slow")
	foreign.Namespace, foreign.Finalizers = "ns", []string{request.CloneProtectionFinalizer}
	foreign.Annotations[volumehelpers.AnnStorageProvisioner] = "other.csi.test"
	foreign.Spec.VolumeName = "pv-foreign"
	foreignPV := &v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-foreign"}, Spec: v1.PersistentVolumeSpec{
		PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: "other.csi.test", VolumeHandle: "h"}},
		ClaimRef:               &v1.ObjectReference{Namespace: "ns", Name: "foreign", UID: "uid-foreign"},
	}}
	w := newWorld(t, testdriver.Config{}, nil, class("fast", nil), class("slow", func(sc *storagev1.StorageClass) { sc.Provisioner = "other.csi.test" }),
		foreignPV, foreign, oursPV, ours)
	finalizers := func(name string) []string {
		c, err := w.kube.CoreV1().PersistentVolumeClaims("ns").Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return c.Finalizers
	}
	w.waitFor("our claim's cloning finalizer removed", func() bool { return !slices.Contains(finalizers(ours.Name), request.CloneProtectionFinalizer) })
	// One worker takes the keys in order: a claim added later is handled after the foreign one.
	late := claimFor("late", "uid-late", "fast")
	late.Namespace, late.Finalizers = "ns", []string{request.CloneProtectionFinalizer}
	w.create(late)
	w.waitFor("the later claim's cloning finalizer removed", func() bool { return !slices.Contains(finalizers("late"), request.CloneProtectionFinalizer) })
	if !slices.Contains(finalizers("foreign"), request.CloneProtectionFinalizer) {
		t.Errorf("another driver's cloning finalizer was removed")
	}
}

// noWatchList tells client-go's informers that the generated snapshot fake cannot stream
// lists (it predates watch-list); they then list and watch as before.
type noWatchList struct{ *snapfake.Clientset }

func (noWatchList) IsWatchListSemanticsUnSupported() bool { return true }

func TestTheCloningFinalizerStaysWhileTheFirstCreateVolumeRunsEvenIfTheClaimIsDeleted(t *testing.T) {
	caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CLONE_VOLUME)
	src, srcPV := boundSource()
	w := newWorld(t, testdriver.Config{ControllerCapabilities: caps}, nil, class("fast", nil), src)
	srcPV.Spec.CSI.VolumeHandle = w.sourceVolume()
	w.create(srcPV)
	// When each write of the source's finalizers was made, and what it said.
	type change struct {
		at  time.Time
		has bool
	}
	var (
		mu      sync.Mutex
		changes []change
	)
	w.kube.PrependReactor("update", "persistentvolumeclaims", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if c := a.(k8stesting.UpdateAction).GetObject().(*v1.PersistentVolumeClaim); c.Name == "src" {
			mu.Lock()
			changes = append(changes, change{time.Now(), slices.Contains(c.Finalizers, request.CloneProtectionFinalizer)})
			mu.Unlock()
		}
		return false, nil, nil
	})
	w.driver.SetMethodLatency(testdriver.MethodCreateVolume, 500*time.Millisecond)
	dst := claimFor("dst", "uid-dst", "fast")
	dst.Namespace = "ns"
	dst.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: request.PVCKind, Name: "src"}
	w.create(dst)
	clone := func() (testdriver.Call, bool) {
		for _, c := range w.calls(testdriver.MethodCreateVolume) {
			if c.VolumeName == "pvc-uid-dst" {
				return c, true
			}
		}
		return testdriver.Call{}, false
	}
	w.waitFor("the clone's CreateVolume in flight", func() bool { _, ok := clone(); return ok })
	if err := w.kube.CoreV1().PersistentVolumeClaims("ns").Delete(context.Background(), "dst", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the cloning finalizer gone", func() bool {
		c, err := w.kube.CoreV1().PersistentVolumeClaims("ns").Get(context.Background(), "src", metav1.GetOptions{})
		return err == nil && !slices.Contains(c.Finalizers, request.CloneProtectionFinalizer)
	})
	call, _ := clone()
	mu.Lock()
	defer mu.Unlock()
	if len(changes) < 2 || !changes[0].has {
		t.Fatalf("source finalizer writes %+v: want it added, then removed", changes)
	}
	for _, c := range changes[1:] {
		if !c.has && (!call.Done() || c.at.Before(call.End)) {
			t.Errorf("the cloning finalizer was removed at %v, while the clone's CreateVolume ran (it ended at %v)", c.at.Format(time.StampMilli), call.End.Format(time.StampMilli))
		}
	}
}

func TestASnapshotWithoutContentLosesItsFinalizerAndOneInUseIsCheckedFromTheCaches(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)
		// Its content deleted: nothing can restore from it.
		gone, _ := snapshotOf("gone", drv, request.SnapshotProtectionFinalizer)
		gone.DeletionTimestamp = ptr.To(metav1.Now())
		// Never bound to a content.
		unbound, _ := snapshotOf("unbound", drv, request.SnapshotProtectionFinalizer)
		unbound.Status = nil
		// In use by a claim of the driver (waiting for its class): kept, from the caches.
		needed, neededContent := snapshotOf("needed", drv, request.SnapshotProtectionFinalizer)
		waiting := claimFor("waiting", "uid-waiting", "missing")
		waiting.Namespace = "ns"
		waiting.Spec.DataSource = &v1.TypedLocalObjectReference{APIGroup: ptr.To(request.SnapshotAPIGroup), Kind: request.SnapshotKind, Name: "needed"}
		snaps := snapfake.NewSimpleClientset(gone, unbound, needed, neededContent)
		w := newWorld(t, testdriver.Config{ControllerCapabilities: caps}, func(c *config) {
			c.snapshotClient = noWatchList{snaps}
			c.opts.snapshotOrphanSweepInterval = 20 * time.Millisecond
		}, waiting)
		finalizers := func(name string) []string {
			s, err := snaps.SnapshotV1().VolumeSnapshots("ns").Get(context.Background(), name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return s.Finalizers
		}
		w.waitFor("the finalizers of the snapshots without content removed", func() bool {
			return !slices.Contains(finalizers("gone"), request.SnapshotProtectionFinalizer) && !slices.Contains(finalizers("unbound"), request.SnapshotProtectionFinalizer)
		})
		// The sweep runs every 20ms and the snapshot in use is retried with backoff: no
		// condition marks "checked and kept", so give it a window of many passes, on the fake
		// clock.
		time.Sleep(10 * time.Second)
		synctest.Wait()
		if !slices.Contains(finalizers("needed"), request.SnapshotProtectionFinalizer) {
			t.Errorf("the finalizer of a snapshot in use was removed")
		}
		for _, a := range snaps.Actions() {
			if g, ok := a.(k8stesting.GetAction); ok && a.GetVerb() == "get" && a.GetResource().Resource == "volumesnapshotcontents" && g.GetName() == "content-needed" {
				t.Errorf("content %s read from the API server: the snapshot in use must be kept from the caches alone", g.GetName())
			}
		}
	})
}
