package provisioner

import (
	"context"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	volumehelpers "k8s.io/component-helpers/storage/volume"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// pvProtection is kube-controller-manager's finalizer on every PersistentVolume: it keeps
// a deleted PersistentVolume until its own controller lets it go, often after ours.
const pvProtection = "kubernetes.io/pv-protection"

// A sync of a PersistentVolume this process deleted, run from a cache that does not show
// the deletion yet, neither calls DeleteVolume again nor writes anything. Under the real
// control loop this is the sync queued by the watch event of our own Delete: it reads the
// cache right after the first sync ended, while the watch events of our finalizer
// removal and of the deletion are on their way. Before, it removed the finalizer a second
// time. (When the informer shows the deletion during the sync's read, lifecycle's
// TestOwnWritesAReadThatMeetsTheInformersDeletionReportsTheObjectMissing holds it.)
func TestADeletedVolumeIsDeletedAndLetGoOnceWhateverTheCacheShows(t *testing.T) {
	for _, tc := range []struct {
		name string
	}{
		{name: "the cache shows the deletion after the sync"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, pvWatch, server := newDeletionWorld(t)
			ctx := context.Background()
			fin := volumehelpers.PVDeletionProtectionFinalizer
			id := w.createVolume("pvc-del")
			pv := releasedPV("pvc-del", id, v1.PersistentVolumeReclaimDelete, pvProtection, fin)
			pv.UID = "uid-pvc-del"
			released, err := w.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			w.show(pvWatch.Add, released)

			if err := w.ctrl.deleter.Sync("pvc-del"); err != nil {
				t.Fatalf("first sync: %v", err)
			}
			if n := len(w.calls(testdriver.MethodDeleteVolume)); n != 1 {
				t.Fatalf("%d DeleteVolume calls after the first sync, want 1", n)
			}
			left := w.pv("pvc-del")
			if left == nil || left.DeletionTimestamp == nil || len(left.Finalizers) != 1 || left.Finalizers[0] != pvProtection {
				t.Fatalf("PersistentVolume after the first sync: %+v, want being deleted with only %s left", left, pvProtection)
			}
			// The watch event of our Delete (being deleted, our finalizer still on)
			// queues the PersistentVolume again; the events of our finalizer removal
			// and of the deletion have not arrived.
			deleting := released.DeepCopy()
			deleting.DeletionTimestamp = left.DeletionTimestamp
			w.show(pvWatch.Modify, deleting)

			if err := w.ctrl.deleter.Sync("pvc-del"); err != nil {
				t.Errorf("second sync: %v", err)
			}

			if calls := w.calls(testdriver.MethodDeleteVolume); len(calls) != 1 {
				t.Errorf("DeleteVolume calls %+v, want exactly one", calls)
			}
			requests := server.requestsMade()
			if n := count(requests, "patch persistentvolumes"); n != 1 {
				t.Errorf("%d patches of the PersistentVolume (the finalizer removal), want 1; requests: %v", n, requests)
			}
			if n := count(requests, "delete persistentvolumes"); n != 1 {
				t.Errorf("%d deletions of the PersistentVolume, want 1; requests: %v", n, requests)
			}
		})
	}
}

// newDeletionWorld is a held world (no workers: the test runs each sync itself) whose
// PersistentVolume informer sees only what the test shows it (pvWatch), served with the API
// server's finalizer semantics and upstream's RBAC (server).
func newDeletionWorld(t *testing.T) (*world, *watch.FakeWatcher, *apiServer) {
	t.Helper()
	pvWatch := watch.NewFakeWithChanSize(10, false)
	var server *apiServer
	w := newHeldWorld(t, testdriver.Config{}, func(c *config) {
		kube := c.kube.(*fake.Clientset)
		kube.PrependWatchReactor("persistentvolumes", func(k8stesting.Action) (bool, watch.Interface, error) {
			return true, pvWatch, nil
		})
		server = &apiServer{tracker: kube.Tracker(), grants: upstreamRBAC}
		c.kube = server.kubeClient()
	}, class("fast", nil), &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "del-creds", Namespace: "ns"}})
	return w, pvWatch, server
}

// show sends a watch event of pv and waits until the controller's handler has queued it,
// so the cache shows it; the queue is left empty.
func (w *world) show(send func(runtime.Object), pv *v1.PersistentVolume) {
	w.t.Helper()
	send(pv)
	w.nextVolume(pv.Name)
}

// showGone sends the deletion of pv and waits until the controller's handler has seen it:
// it sees events in order, so once it queued a PersistentVolume added after the deletion,
// it has handled the deletion.
func (w *world) showGone(pvWatch *watch.FakeWatcher, pv *v1.PersistentVolume) {
	w.t.Helper()
	pvWatch.Delete(pv)
	marker := releasedPV("marker", "vol-marker", v1.PersistentVolumeReclaimRetain)
	pvWatch.Add(marker)
	w.nextVolume(marker.Name)
}

// nextVolume waits for name in the volume queue and takes it; nothing else may come first.
func (w *world) nextVolume(name string) {
	w.t.Helper()
	q := w.ctrl.deleter.Queue()
	if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return q.Len() > 0, nil
	}); err != nil {
		w.t.Fatalf("%s not queued", name)
	}
	got, _ := q.Get()
	q.Done(got)
	if got != name {
		w.t.Fatalf("queued %q, want %q", got, name)
	}
}
