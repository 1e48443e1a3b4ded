package provisioner

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// grants is what an RBAC role allows: resource ("resource/subresource" for a subresource)
// to verbs.
type grants map[string][]string

// upstreamRBAC is external-provisioner v6.4.0's deploy/kubernetes/rbac.yaml: the
// ClusterRole external-provisioner-runner and the Role external-provisioner-cfg (leases
// are the core's, not the provisioner's), with the secrets rule uncommented as the file
// says to for drivers that use secrets.
var upstreamRBAC = grants{
	"persistentvolumes":      {"get", "list", "watch", "create", "patch", "delete"},
	"persistentvolumeclaims": {"get", "list", "watch", "update"},
	"storageclasses":         {"get", "list", "watch"},
	"events":                 {"list", "watch", "create", "update", "patch"},
	"volumesnapshots":        {"get", "list", "watch", "update"},
	"volumesnapshotcontents": {"get", "list"},
	"csinodes":               {"get", "list", "watch"},
	"nodes":                  {"get", "list", "watch"},
	"volumeattachments":      {"get", "list", "watch"},
	"csistoragecapacities":   {"get", "list", "watch", "create", "update", "patch", "delete"},
	"pods":                   {"get"},
	"replicasets":            {"get"},
	"secrets":                {"get", "list"},
}

// upstreamRBACBeforeV62 is the same file at v6.0.0 and v6.1.x: no watch nor update on
// volumesnapshots.
var upstreamRBACBeforeV62 = func() grants {
	g := grants{}
	for r, verbs := range upstreamRBAC {
		g[r] = verbs
	}
	g["volumesnapshots"] = []string{"get", "list"}
	return g
}()

// apiServer serves a fake clientset from another's object tracker, as an API server
// would serve a client holding only the granted verbs: everything else is Forbidden and
// recorded. It also deletes as the API server does, which the fake tracker does not: an
// object with finalizers only gets a deletion timestamp, and goes when a write removes
// its last finalizer.
type apiServer struct {
	tracker k8stesting.ObjectTracker
	grants  grants

	mu       sync.Mutex
	requests []string // "verb resource", every one
	refused  []string // "verb resource", the refused ones
}

// kubeClient is a clientset over admin's objects holding the server's grants; admin (the
// test) still writes freely.
func (s *apiServer) kubeClient() *fake.Clientset {
	c := &fake.Clientset{}
	s.serve(&c.Fake)
	return c
}

func (s *apiServer) snapshotClient() *snapfake.Clientset {
	c := &snapfake.Clientset{}
	s.serve(&c.Fake)
	return c
}

func (s *apiServer) serve(f *k8stesting.Fake) {
	objects := k8stesting.ObjectReaction(s.tracker)
	stampResourceVersions(f)
	f.AddReactor("*", "*", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if err := s.authorize(a); err != nil {
			return true, nil, err
		}
		return s.react(a, objects)
	})
	f.AddWatchReactor("*", func(a k8stesting.Action) (bool, watch.Interface, error) {
		if err := s.authorize(a); err != nil {
			return true, nil, err
		}
		var opts metav1.ListOptions
		if w, ok := a.(k8stesting.WatchActionImpl); ok {
			opts = w.ListOptions
		}
		w, err := s.tracker.Watch(a.GetResource(), a.GetNamespace(), opts)
		return true, w, err
	})
}

func (s *apiServer) authorize(a k8stesting.Action) error {
	resource := a.GetResource().Resource
	if sub := a.GetSubresource(); sub != "" {
		resource += "/" + sub
	}
	request := a.GetVerb() + " " + resource
	s.mu.Lock()
	defer s.mu.Unlock()
	s.requests = append(s.requests, request)
	if slices.Contains(s.grants[resource], a.GetVerb()) {
		return nil
	}
	s.refused = append(s.refused, request)
	return apierrors.NewForbidden(a.GetResource().GroupResource(), "", fmt.Errorf("RBAC: %s on %s is not granted", a.GetVerb(), resource))
}

// react applies the action to the tracker with the API server's finalizer semantics.
func (s *apiServer) react(a k8stesting.Action, objects k8stesting.ReactionFunc) (bool, runtime.Object, error) {
	switch a := a.(type) {
	case k8stesting.DeleteActionImpl:
		obj, err := s.tracker.Get(a.GetResource(), a.GetNamespace(), a.GetName())
		if err != nil {
			return true, nil, err
		}
		m, err := meta.Accessor(obj)
		if err != nil {
			return true, nil, err
		}
		if len(m.GetFinalizers()) > 0 {
			if m.GetDeletionTimestamp() == nil {
				m.SetDeletionTimestamp(ptr.To(metav1.Now()))
				err = s.tracker.Update(a.GetResource(), obj, a.GetNamespace())
			}
			return true, nil, err
		}
	case k8stesting.UpdateActionImpl, k8stesting.PatchActionImpl:
		handled, obj, err := objects(a)
		if err != nil || obj == nil {
			return handled, obj, err
		}
		m, err := meta.Accessor(obj)
		if err != nil {
			return true, nil, err
		}
		if m.GetDeletionTimestamp() != nil && len(m.GetFinalizers()) == 0 {
			err = s.tracker.Delete(a.GetResource(), m.GetNamespace(), m.GetName())
		}
		return handled, obj, err
	}
	return objects(a)
}

// requestsMade returns the requests so far.
func (s *apiServer) requestsMade() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.requests)
}

// refusals returns the refused requests so far.
func (s *apiServer) refusals() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.refused)
}

func count(list []string, item string) int {
	n := 0
	for _, x := range list {
		if x == item {
			n++
		}
	}
	return n
}

// Deletion with upstream's RBAC (patch, no update, on persistentvolumes): the volume is
// deleted once, and its PersistentVolume goes, even when the write that removes the
// finalizer must be retried; a finalizer someone else adds meanwhile stays.
func TestUnderUpstreamRBACAReleasedVolumeIsDeletedOnceAndItsPersistentVolumeLetGo(t *testing.T) {
	const other = "example.com/keep"
	fin := volumehelpers.PVDeletionProtectionFinalizer
	for _, tc := range []struct {
		name string
		// firstPatch, when set, answers the first finalizer patch of the deleted
		// PersistentVolume instead of the server.
		firstPatch func(*apiServer) error
		// wantFinalizers: nil when the PersistentVolume must be gone.
		wantFinalizers []string
	}{
		{name: "nothing in the way"},
		{name: "the finalizer patch fails once", firstPatch: func(*apiServer) error {
			return apierrors.NewInternalError(fmt.Errorf("etcd hiccup"))
		}},
		{name: "someone adds a finalizer meanwhile", firstPatch: func(s *apiServer) error {
			// What the resource version precondition turns a concurrent write into.
			obj, err := s.tracker.Get(v1.SchemeGroupVersion.WithResource("persistentvolumes"), "", "pvc-del")
			if err != nil {
				return err
			}
			pv := obj.(*v1.PersistentVolume)
			pv.Finalizers = append(pv.Finalizers, other)
			if err := s.tracker.Update(v1.SchemeGroupVersion.WithResource("persistentvolumes"), pv, ""); err != nil {
				return err
			}
			return apierrors.NewConflict(v1.Resource("persistentvolumes"), "pvc-del", fmt.Errorf("the object has been modified"))
		}, wantFinalizers: []string{other}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var server *apiServer
				var patched sync.Once
				w := newWorld(t, testdriver.Config{}, func(c *config) {
					server = &apiServer{tracker: c.kube.(*fake.Clientset).Tracker(), grants: upstreamRBAC}
					client := server.kubeClient()
					if tc.firstPatch != nil {
						client.PrependReactor("patch", "persistentvolumes", func(a k8stesting.Action) (bool, runtime.Object, error) {
							obj, err := server.tracker.Get(a.GetResource(), "", a.(k8stesting.PatchAction).GetName())
							if err != nil || obj.(*v1.PersistentVolume).DeletionTimestamp == nil {
								return false, nil, nil
							}
							var injected error
							patched.Do(func() { injected = tc.firstPatch(server) })
							return injected != nil, nil, injected
						})
					}
					c.kube = client
				}, class("fast", nil), &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "del-creds", Namespace: "ns"}})
				id := w.createVolume("pvc-del")
				w.create(releasedPV("pvc-del", id, v1.PersistentVolumeReclaimDelete, fin))

				if tc.wantFinalizers == nil {
					w.waitFor("the PersistentVolume gone", func() bool { return w.pv("pvc-del") == nil })
				} else {
					w.waitFor("our finalizer removed", func() bool {
						pv := w.pv("pvc-del")
						return pv != nil && !slices.Contains(pv.Finalizers, fin)
					})
					if pv := w.pv("pvc-del"); pv.DeletionTimestamp == nil || !slices.Equal(pv.Finalizers, tc.wantFinalizers) {
						t.Errorf("PersistentVolume deleting %v with finalizers %v, want deleting with %v", pv.DeletionTimestamp != nil, pv.Finalizers, tc.wantFinalizers)
					}
				}
				if _, ok := w.driver.Volume(id); ok {
					t.Error("the volume is still in the driver")
				}
				// Let any retry in the queue happen before counting: a retry backs off 200ms at
				// most here, and the fake clock moves a minute.
				time.Sleep(time.Minute)
				synctest.Wait()
				if calls := w.calls(testdriver.MethodDeleteVolume); len(calls) != 1 || calls[0].VolumeID != id {
					t.Errorf("DeleteVolume calls %+v, want exactly one for %s", calls, id)
				}
				if r := server.refusals(); len(r) != 0 {
					t.Errorf("requests upstream's RBAC refuses: %v", r)
				}
				for _, e := range w.events() {
					if strings.Contains(e, "VolumeFailedDelete") {
						t.Errorf("event %q about a volume that was deleted", e)
					}
				}
			})
		})
	}
}

// ResourceExhausted on the selected node hands the claim back to the scheduler with the
// verbs upstream's RBAC grants on claims (update, no patch).
func TestUnderUpstreamRBACAnExhaustedNodeIsHandedBackToTheScheduler(t *testing.T) {
	sc := class("late", func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	})
	claim := claimFor("data", "uid-1", "late")
	claim.Annotations[volumehelpers.AnnSelectedNode] = "n1"
	var server *apiServer
	w := newWorld(t, testdriver.Config{Topology: true}, func(c *config) {
		server = &apiServer{tracker: c.kube.(*fake.Clientset).Tracker(), grants: upstreamRBAC}
		c.kube = server.kubeClient()
	}, sc, node("n1", map[string]string{testdriver.TopologyKey: "n1"}), csiNode("n1", testdriver.TopologyKey))
	if err := w.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: codes.ResourceExhausted, Times: 1}); err != nil {
		t.Fatal(err)
	}
	w.create(claim)
	claims := w.kube.CoreV1().PersistentVolumeClaims("ns")
	w.waitFor("the selected node removed", func() bool {
		c, err := claims.Get(context.Background(), "data", metav1.GetOptions{})
		_, selected := c.Annotations[volumehelpers.AnnSelectedNode]
		return err == nil && !selected
	})
	// The driver answered for good that it made nothing: the record closes without a call.
	w.waitFor("the provisioning record closed", func() bool { return w.record("uid-1") == nil })
	if calls := w.calls(testdriver.MethodCreateVolume); len(calls) != 1 || calls[0].Code != codes.ResourceExhausted.String() {
		t.Errorf("CreateVolume calls %+v, want one that ran out of space", calls)
	}
	if n := len(w.calls(testdriver.MethodDeleteVolume)); n != 0 {
		t.Errorf("%d DeleteVolume calls for a volume the driver never made", n)
	}
	if r := server.refusals(); len(r) != 0 {
		t.Errorf("requests upstream's RBAC refuses: %v", r)
	}

	// The scheduler picks again: the claim gets its volume.
	c, err := claims.Get(context.Background(), "data", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c.Annotations[volumehelpers.AnnSelectedNode] = "n1"
	if _, err := claims.Update(context.Background(), c, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the PersistentVolume", func() bool { return w.pv("pvc-uid-1") != nil })
}

// readySnapshot makes a snapshot in the driver of a new volume and returns a ready
// VolumeSnapshot of it, bound to its content.
func (w *world) readySnapshot(name string) (*snapshotv1.VolumeSnapshot, *snapshotv1.VolumeSnapshotContent) {
	w.t.Helper()
	resp, err := w.ctrl.csi.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{SourceVolumeId: w.sourceVolume(), Name: name})
	if err != nil {
		w.t.Fatal(err)
	}
	snap, content := snapshotOf(name, drv)
	content.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: ptr.To(resp.GetSnapshot().GetSnapshotId())}
	return snap, content
}

// Restore with the RBAC of upstream before v6.2 (get and list on volumesnapshots): the
// finalizer cannot go on the snapshot; the volume is restored anyway, and the refusal is
// one warning.
func TestARestoreWorksWhenTheSnapshotUpdateIsForbidden(t *testing.T) {
	caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)
	snaps := snapfake.NewSimpleClientset()
	var kubeServer *apiServer
	snapServer := &apiServer{tracker: snaps.Tracker(), grants: upstreamRBACBeforeV62}
	w := newWorld(t, testdriver.Config{ControllerCapabilities: caps}, func(c *config) {
		kubeServer = &apiServer{tracker: c.kube.(*fake.Clientset).Tracker(), grants: upstreamRBACBeforeV62}
		c.kube = kubeServer.kubeClient()
		c.snapshotClient = snapServer.snapshotClient()
	}, class("fast", nil))
	snap, content := w.readySnapshot("snap")
	ctx := context.Background()
	if _, err := snaps.SnapshotV1().VolumeSnapshotContents().Create(ctx, content, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := snaps.SnapshotV1().VolumeSnapshots("ns").Create(ctx, snap, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	claim := claimFor("restored", "uid-r", "fast")
	claim.Spec.DataSource = &v1.TypedLocalObjectReference{APIGroup: ptr.To(request.SnapshotAPIGroup), Kind: request.SnapshotKind, Name: "snap"}
	w.create(claim)

	w.waitFor("the restored volume's PersistentVolume", func() bool { return w.pv("pvc-uid-r") != nil })
	var restored *testdriver.Call
	for _, c := range w.calls(testdriver.MethodCreateVolume) {
		if c.VolumeName == "pvc-uid-r" {
			restored = &c
		}
	}
	if restored == nil {
		t.Fatal("no CreateVolume for the claim")
	}
	if v, _ := w.driver.Volume(restored.VolumeID); v.ContentSource.GetSnapshot().GetSnapshotId() != *content.Status.SnapshotHandle {
		t.Errorf("volume made from %v, want snapshot %s", v.ContentSource, *content.Status.SnapshotHandle)
	}
	if r := snapServer.refusals(); count(r, "update volumesnapshots") == 0 {
		t.Errorf("refusals %v: the finalizer was never tried", r)
	}
	for _, r := range append(snapServer.refusals(), kubeServer.refusals()...) {
		if r != "update volumesnapshots" && r != "watch volumesnapshots" {
			t.Errorf("refused %q: not a verb the old RBAC lacks", r)
		}
	}
	if !w.ctrl.sources.WarnedOfMissingSnapshotUpdate() {
		t.Error("no warning about the missing update permission")
	}
	got, err := snaps.SnapshotV1().VolumeSnapshots("ns").Get(ctx, "snap", metav1.GetOptions{})
	if err != nil || len(got.Finalizers) != 0 {
		t.Errorf("snapshot %v, err %v: want it untouched", got.Finalizers, err)
	}
}

// A finalizer left on a snapshot (RBAC downgraded since) that cannot be removed is not
// retried with backoff like a failure: only the informer's next look (a relist, the sweep)
// tries again.
func TestAForbiddenSnapshotFinalizerRemovalIsNotRetriedInALoop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)
		orphan, content := snapshotOf("orphan", drv, request.SnapshotProtectionFinalizer)
		snaps := snapfake.NewSimpleClientset(orphan, content)
		snapServer := &apiServer{tracker: snaps.Tracker(), grants: upstreamRBACBeforeV62}
		w := newWorld(t, testdriver.Config{ControllerCapabilities: caps}, func(c *config) {
			c.snapshotClient = snapServer.snapshotClient()
		})
		w.waitFor("the removal refused", func() bool { return count(snapServer.refusals(), "update volumesnapshots") > 0 })
		// Retries with backoff (20ms doubling to 200ms here) would try about 300 times in a
		// minute of the fake clock.
		time.Sleep(time.Minute)
		synctest.Wait()
		// What may wake the snapshot: each list of the snapshots (the first, and a relist
		// after a refused watch), and the orphan sweep's first pass, at start.
		wakes := count(snapServer.requestsMade(), "list volumesnapshots") + 1
		if n := count(snapServer.refusals(), "update volumesnapshots"); n > wakes {
			t.Errorf("%d refused removals for %d wakes of the snapshot: retried in a loop", n, wakes)
		}
		if !w.ctrl.sources.WarnedOfMissingSnapshotUpdate() {
			t.Error("no warning about the missing update permission")
		}
	})
}
