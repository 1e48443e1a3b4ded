package provisioner

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/provisioner/record"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// servedWorld is a world whose controller talks to an API server that deletes as the real
// one does (an object with finalizers only gets a deletion timestamp) and grants exactly
// upstream's RBAC; admin is a client of the same objects for the test, which may do
// anything.
type servedWorld struct {
	*world
	server *apiServer
	admin  *fake.Clientset
}

func newServedWorld(t *testing.T, dcfg testdriver.Config, change func(*config), objects ...runtime.Object) *servedWorld {
	t.Helper()
	sw := newHeldServedWorld(t, dcfg, change, objects...)
	sw.start()
	return sw
}

// newHeldServedWorld is newServedWorld before its workers start (newHeldWorld).
func newHeldServedWorld(t *testing.T, dcfg testdriver.Config, change func(*config), objects ...runtime.Object) *servedWorld {
	t.Helper()
	sw := &servedWorld{}
	sw.world = newHeldWorld(t, dcfg, func(c *config) {
		tracker := c.kube.(*fake.Clientset).Tracker()
		sw.server = &apiServer{tracker: tracker, grants: upstreamRBAC}
		sw.admin = (&apiServer{tracker: tracker, grants: grants{
			"persistentvolumeclaims": {"get", "create", "update", "delete"},
			"persistentvolumes":      {"get", "create"},
			"secrets":                {"create"},
			"storageclasses":         {"delete"},
		}}).kubeClient()
		// The test's change sees the plain fake, to set up objects before anything runs.
		if change != nil {
			change(c)
		}
		c.kube = sw.server.kubeClient()
	}, objects...)
	t.Cleanup(func() {
		if r := sw.server.refusals(); len(r) != 0 {
			t.Errorf("requests upstream's RBAC refuses: %v", r)
		}
	})
	return sw
}

// claim reads a claim of namespace ns; nil when it is gone.
func (w *servedWorld) claim(name string) *v1.PersistentVolumeClaim {
	c, err := w.admin.CoreV1().PersistentVolumeClaims("ns").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		return nil
	}
	return c
}

func carriesRecord(c *v1.PersistentVolumeClaim) bool {
	return c != nil && (record.Has(c) || slices.Contains(c.Finalizers, record.ProvisioningFinalizer))
}

// startWith adds what a dead leader left (claims, PersistentVolumes, record events), waits
// until the caches show all of it, then starts the workers, as a new leader would.
func (w *servedWorld) startWith(objs ...any) {
	w.t.Helper()
	w.create(objs...)
	w.waitFor("the caches to show what the dead leader left", func() bool {
		for _, o := range objs {
			switch o := o.(type) {
			case *v1.PersistentVolumeClaim:
				if w.ctrl.claimByUID(string(o.UID)) == nil {
					return false
				}
			case *v1.PersistentVolume:
				if !w.ctrl.pvExists(o.Name) {
					return false
				}
			case *v1.Event:
				if !w.ctrl.records.IsOpen(o.Labels[record.LabelClaim]) {
					return false
				}
			}
		}
		return true
	})
	w.start()
}

// recordOpen tells whether the claim of uid has an open record, in events or (an earlier
// version's) on the claim.
func (w *servedWorld) recordOpen(uid, name string) bool {
	return w.record(uid) != nil || carriesRecord(w.claim(name))
}

func (w *servedWorld) hasEvent(reason, text string) bool {
	return slices.ContainsFunc(w.events(), func(e string) bool { return strings.Contains(e, reason) && strings.Contains(e, text) })
}

// P1 and the record: it is open (upstream's "Provisioning" event, carrying it) before the
// driver is asked for the volume, and closed (upstream's "ProvisioningSucceeded") once the
// PersistentVolume records the volume: three writes, as upstream, and none of the claim;
// no write needs more than upstream's RBAC.
func TestTheRecordIsOpenWhileCreateVolumeRunsAndClosedWithThePersistentVolume(t *testing.T) {
	w := newServedWorld(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 300 * time.Millisecond}},
		nil, class("fast", nil), claimFor("data", "uid-1", "fast"))
	w.waitFor("CreateVolume running", func() bool {
		calls := w.calls(testdriver.MethodCreateVolume)
		return len(calls) == 1 && !calls[0].Done()
	})
	r := w.record("uid-1")
	if r == nil {
		t.Fatal("no open record while CreateVolume runs")
	}
	if rec := r.Record; rec.Volume != "pvc-uid-1" || rec.Driver != drv || rec.CreateVolumeRequest().GetParameters()["type"] != "fast" || rec.Claim.Name != "data" {
		t.Errorf("record %+v asking %v, want volume pvc-uid-1 of %s as planned, about claim data", rec, rec.CreateVolumeRequest(), drv)
	}
	if c := w.claim("data"); carriesRecord(c) || len(c.Finalizers) != 0 {
		t.Errorf("claim finalizers %v, annotations %v: want the claim untouched", c.Finalizers, c.Annotations)
	}
	w.waitFor("the PersistentVolume, then the record closed", func() bool { return w.pv("pvc-uid-1") != nil && w.record("uid-1") == nil })
	var writes []string
	for _, r := range w.server.requestsMade() {
		if verb, _, _ := strings.Cut(r, " "); !slices.Contains([]string{"get", "list", "watch"}, verb) {
			writes = append(writes, r)
		}
	}
	if want := []string{"create events", "create persistentvolumes", "create events"}; !slices.Equal(writes, want) {
		t.Errorf("writes %q, want %q (upstream's three)", writes, want)
	}
	var reasons []string
	for _, e := range w.events() {
		reasons = append(reasons, strings.Fields(e)[1])
	}
	if !slices.Equal(reasons, []string{record.ReasonProvisioning, record.ReasonSucceeded}) {
		t.Errorf("events %q, want upstream's Provisioning, then ProvisioningSucceeded", reasons)
	}
}

// A claim deleted while its CreateVolume runs stays only until the volume made for it is
// deleted: no PersistentVolume, nothing in the driver, one DeleteVolume, and no second
// CreateVolume (its ID was known).
func TestAClaimDeletedWhileItsCreateVolumeRunsGoesOnceItsVolumeIsDeleted(t *testing.T) {
	w := newServedWorld(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 300 * time.Millisecond}},
		nil, class("fast", nil), claimFor("data", "uid-1", "fast"))
	w.waitFor("CreateVolume running", func() bool { return len(w.calls(testdriver.MethodCreateVolume)) == 1 })
	if err := w.admin.CoreV1().PersistentVolumeClaims("ns").Delete(context.Background(), "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if c := w.claim("data"); c != nil {
		t.Fatalf("claim %v: want it gone at once, as upstream (the record is not on it)", c)
	}
	w.waitFor("the record closed", func() bool { return w.record("uid-1") == nil })
	if n := len(w.driver.Volumes()); n != 0 {
		t.Errorf("%d volumes left in the driver", n)
	}
	if w.pv("pvc-uid-1") != nil {
		t.Error("a PersistentVolume was saved for a deleted claim")
	}
	if n, d := len(w.calls(testdriver.MethodCreateVolume)), len(w.calls(testdriver.MethodDeleteVolume)); n != 1 || d != 1 {
		t.Errorf("%d CreateVolume and %d DeleteVolume calls, want 1 and 1", n, d)
	}
	if !w.hasEvent(reasonUndone, "the claim is gone") {
		t.Error("no event says the provisioning was undone")
	}
}

// A final answer from the driver says it has no volume: a claim deleted after one loses its
// record with no further CSI call.
func TestAClaimDeletedAfterAFinalErrorLosesItsRecordWithoutAnotherCall(t *testing.T) {
	w := newServedWorld(t, testdriver.Config{}, nil, class("fast", nil))
	if err := w.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: codes.InvalidArgument, Times: 1000}); err != nil {
		t.Fatal(err)
	}
	w.create(claimFor("data", "uid-1", "fast"))
	w.waitFor("a failed CreateVolume", func() bool { return len(w.calls(testdriver.MethodCreateVolume)) > 0 })
	if w.record("uid-1") == nil {
		t.Fatal("the record was closed while the claim still wants a volume")
	}
	if err := w.admin.CoreV1().PersistentVolumeClaims("ns").Delete(context.Background(), "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the record closed", func() bool { return w.record("uid-1") == nil })
	if n := len(w.calls(testdriver.MethodDeleteVolume)); n != 0 {
		t.Errorf("%d DeleteVolume calls for a volume the driver never made", n)
	}
	if !w.hasEvent(reasonUndone, "the driver had no volume pvc-uid-1") {
		t.Error("no event says the provisioning was undone")
	}
}

// requests records the secrets each CSI call was sent with.
type secretsSeen struct {
	csi.ControllerClient
	mu            sync.Mutex
	create, erase []map[string]string
}

func (s *secretsSeen) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest, opts ...grpc.CallOption) (*csi.CreateVolumeResponse, error) {
	s.mu.Lock()
	s.create = append(s.create, req.GetSecrets())
	s.mu.Unlock()
	return s.ControllerClient.CreateVolume(ctx, req, opts...)
}

func (s *secretsSeen) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest, opts ...grpc.CallOption) (*csi.DeleteVolumeResponse, error) {
	s.mu.Lock()
	s.erase = append(s.erase, req.GetSecrets())
	s.mu.Unlock()
	return s.ControllerClient.DeleteVolume(ctx, req, opts...)
}

func (s *secretsSeen) all() []map[string]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append(slices.Clone(s.create), s.erase...)
}

// A new leader, or the same process restarted, finds the records a dead leader opened and
// finishes or undoes each as the claim now says; it remembers nothing, the records and the
// claims tell all.
func TestANewLeaderFinishesOrUndoesWhatTheRecordsOfADeadOneSay(t *testing.T) {
	late := class("late", func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
		sc.Parameters[request.ProvisionerSecret.NameKey] = "creds"
		sc.Parameters[request.ProvisionerSecret.NamespaceKey] = "ns"
	})
	for _, tc := range []struct {
		name string
		// made: the dead leader's CreateVolume made the volume.
		made bool
		// change is what happened to the claim since (gone: deleted); saved: its
		// PersistentVolume exists.
		change      func(*v1.PersistentVolumeClaim)
		gone        bool
		saved       bool
		classGone   bool
		createFault codes.Code
		// want: the claim gets (keeps) its volume, on wantNode; else it is gone and so is
		// every volume.
		want        bool
		wantNode    string
		wantDeletes int
		wantCreates int
		wantEvent   string
		// legacy: the record is on the claim, as earlier versions kept it.
		legacy bool
		// aged: its event is older than record.RefreshAfter, soon to expire.
		aged bool
	}{
		{name: "still wanted: finished", made: true, want: true, wantNode: "n1", wantCreates: 1},
		{name: "still wanted, never made: made", want: true, wantNode: "n1", wantCreates: 1},
		{name: "still wanted, its record about to expire: written again and finished, never undone", made: true, aged: true, want: true, wantNode: "n1", wantCreates: 1},
		{name: "deleted: its volume is deleted", made: true, gone: true, wantCreates: 1, wantDeletes: 1, wantEvent: "the claim is gone"},
		{name: "deleted, never made: made to learn its ID and deleted", gone: true, wantCreates: 1, wantDeletes: 1, wantEvent: "volume pvc-uid-1 deleted"},
		{name: "deleted, its StorageClass too: the recorded request and secret are used", made: true, gone: true, classGone: true, wantCreates: 1, wantDeletes: 1},
		{name: "deleted, the driver cannot make it: nothing to delete", gone: true, createFault: codes.InvalidArgument, wantCreates: 1, wantEvent: "the driver had no volume"},
		{name: "rescheduled: undone on the old node, made on the new one", made: true, want: true, wantNode: "n2", wantCreates: 2, wantDeletes: 1,
			change: func(c *v1.PersistentVolumeClaim) { c.Annotations[volumehelpers.AnnSelectedNode] = "n2" }, wantEvent: "from node n1 to n2"},
		{name: "its PersistentVolume was saved: only the record closes", made: true, saved: true, want: true, wantNode: "n1"},
		{name: "an earlier version's record on a deleted claim: undone, the claim let go", made: true, legacy: true, wantCreates: 1, wantDeletes: 1, wantEvent: "being deleted",
			change: func(c *v1.PersistentVolumeClaim) { c.DeletionTimestamp = ptr.To(metav1.Now()) }},
		{name: "an earlier version's record, still wanted: finished, the claim let go", made: true, legacy: true, want: true, wantNode: "n1", wantCreates: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seen := &secretsSeen{}
			creds := &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds", Namespace: "ns"}, Data: map[string][]byte{"token": []byte("t")}}
			w := newHeldServedWorld(t, testdriver.Config{Topology: true}, func(c *config) {
				seen.ControllerClient = c.csi
				c.csi = seen
			}, late, creds, node("n1", map[string]string{testdriver.TopologyKey: "n1"}), csiNode("n1", testdriver.TopologyKey),
				node("n2", map[string]string{testdriver.TopologyKey: "n2"}), csiNode("n2", testdriver.TopologyKey))

			// What the dead leader planned, recorded, and maybe made.
			claim := claimFor("data", "uid-1", "late")
			claim.Annotations[volumehelpers.AnnSelectedNode] = "n1"
			p, err := w.ctrl.planner.plan(claim, late)
			if err != nil {
				t.Fatal(err)
			}
			rec, err := record.New(drv, "n1", p.pv.secrets.Provisioner, p.req)
			if err != nil {
				t.Fatal(err)
			}
			var left []any
			if tc.legacy {
				value, _ := rec.Encode()
				claim = record.With(claim, value)
			} else {
				ev := deadLeaderRecord(t, claim, rec)
				if tc.aged {
					old := metav1.NewTime(time.Now().Add(-record.RefreshAfter - time.Minute))
					ev.FirstTimestamp, ev.LastTimestamp = old, old
				}
				left = append(left, ev)
			}
			var made string
			if tc.made {
				resp, err := seen.ControllerClient.CreateVolume(context.Background(), p.req)
				if err != nil {
					t.Fatal(err)
				}
				made = resp.GetVolume().GetVolumeId()
			}
			if tc.saved {
				p.pv.volume = &csi.Volume{VolumeId: made, AccessibleTopology: []*csi.Topology{{Segments: map[string]string{testdriver.TopologyKey: "n1"}}}}
				pv, err := buildPV(p.pv)
				if err != nil {
					t.Fatal(err)
				}
				left = append(left, pv)
			}
			if tc.classGone {
				if err := w.admin.StorageV1().StorageClasses().Delete(context.Background(), "late", metav1.DeleteOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			if tc.createFault != codes.OK {
				if err := w.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: tc.createFault, Times: 1000}); err != nil {
					t.Fatal(err)
				}
			}
			if tc.change != nil {
				tc.change(claim)
			}
			if !tc.gone {
				left = append([]any{claim}, left...)
			}
			w.startWith(left...)

			if tc.want {
				w.waitFor("the PersistentVolume, and the record closed", func() bool { return w.pv("pvc-uid-1") != nil && !w.recordOpen("uid-1", "data") })
				vols := w.driver.Volumes()
				if len(vols) != 1 || vols[0].ID != w.pv("pvc-uid-1").Spec.CSI.VolumeHandle || vols[0].AccessibleTopology[0].Segments[testdriver.TopologyKey] != tc.wantNode {
					t.Errorf("volumes %+v, want one on %s, the PersistentVolume's", vols, tc.wantNode)
				}
			} else {
				w.waitFor("the record closed, the claim gone", func() bool { return w.claim("data") == nil && !w.recordOpen("uid-1", "data") })
				if vols := w.driver.Volumes(); len(vols) != 0 || w.pv("pvc-uid-1") != nil {
					t.Errorf("volumes %+v left in the driver, PersistentVolume %v", vols, w.pv("pvc-uid-1"))
				}
			}
			creates, deletes := 0, w.calls(testdriver.MethodDeleteVolume)
			for _, c := range w.calls(testdriver.MethodCreateVolume) {
				if c.VolumeName != "pvc-uid-1" {
					t.Errorf("CreateVolume of %s", c.VolumeName)
				}
				creates++
			}
			if tc.made {
				creates-- // the dead leader's
			}
			if creates != tc.wantCreates || len(deletes) != tc.wantDeletes {
				t.Errorf("%d CreateVolume and %d DeleteVolume calls, want %d and %d", creates, len(deletes), tc.wantCreates, tc.wantDeletes)
			}
			if made != "" && tc.wantDeletes > 0 && !tc.want && deletes[0].VolumeID != made {
				t.Errorf("deleted %s, want the dead leader's %s", deletes[0].VolumeID, made)
			}
			for _, s := range seen.all() {
				if s["token"] != "t" {
					t.Errorf("a CSI call was sent with secrets %v, want the provisioner secret", s)
				}
			}
			// The event follows the record's removal, which lets the claim go: wait for it.
			events := w.events()
			undone := func() bool {
				return slices.ContainsFunc(events, func(e string) bool { return strings.Contains(e, reasonUndone) && strings.Contains(e, tc.wantEvent) })
			}
			if tc.wantEvent != "" {
				_ = wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
					events = append(events, w.events()...)
					return undone(), nil
				})
				if !undone() {
					t.Errorf("events %q, want %s saying %q", events, reasonUndone, tc.wantEvent)
				}
			}
			if tc.saved && !slices.ContainsFunc(events, func(e string) bool { return strings.Contains(e, record.ReasonSucceeded) }) {
				t.Errorf("events %q, want %s (the dead leader could not write it)", events, record.ReasonSucceeded)
			}
		})
	}
}

// The undo of a dead leader's record needs the provisioner secret to ask the driver; without
// it the record stays open, with an event on the claim saying why, and closes once the
// secret is back.
func TestAnUndoWithoutItsSecretWaitsWithAnEvent(t *testing.T) {
	sc := class("fast", func(sc *storagev1.StorageClass) {
		sc.Parameters[request.ProvisionerSecret.NameKey] = "creds"
		sc.Parameters[request.ProvisionerSecret.NamespaceKey] = "ns"
	})
	w := newHeldServedWorld(t, testdriver.Config{}, nil, sc)
	rec, err := record.New(drv, "", &v1.SecretReference{Name: "creds", Namespace: "ns"}, objects.CreateVolumeRequest("pvc-uid-1"))
	if err != nil {
		t.Fatal(err)
	}
	// The claim is gone: only its record is left.
	w.startWith(deadLeaderRecord(t, claimFor("data", "uid-1", "fast"), rec))
	w.waitFor("an event naming the missing secret", func() bool { return w.hasEvent(reasonUndoFailed, "creds") })
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 0 || w.record("uid-1") == nil {
		t.Fatalf("%d CreateVolume calls without the secret, record %v: want none, and the record open", n, w.record("uid-1"))
	}
	if _, err := w.admin.CoreV1().Secrets("ns").Create(context.Background(), &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds", Namespace: "ns"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the record closed", func() bool { return w.record("uid-1") == nil })
	if n := len(w.driver.Volumes()); n != 0 {
		t.Errorf("%d volumes left", n)
	}
}

// A record the provisioner cannot trust (it names a volume that is not made from the
// claim's UID: written or edited by hand) is never acted on: another claim's volume is not
// deleted, and an event says so (for an earlier version's record on the claim, which holds
// the claim, what to do).
func TestAnEditedRecordIsNotActedOn(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		t.Run(map[bool]string{false: "event", true: "on the claim"}[legacy], func(t *testing.T) {
			w := newHeldServedWorld(t, testdriver.Config{}, nil, class("fast", nil))
			other := w.createVolume("pvc-uid-other")
			claim := claimFor("data", "uid-1", "fast")
			req := objects.CreateVolumeRequest("pvc-uid-other")
			req.Parameters, req.CapacityRange = nil, nil
			rec, err := record.New(drv, "", nil, req)
			if err != nil {
				t.Fatal(err)
			}
			want := "Check the driver for the volume"
			if legacy {
				value, _ := rec.Encode()
				claim = record.With(claim, value)
				claim.DeletionTimestamp = ptr.To(metav1.Now())
				w.startWith(claim)
				want = record.ProvisioningFinalizer
			} else {
				w.startWith(deadLeaderRecord(t, claim, rec))
			}
			w.waitFor("an event saying the record is not trusted", func() bool { return w.hasEvent(reasonUntrusted, want) })
			if _, ok := w.driver.Volume(other); !ok || len(w.calls(testdriver.MethodDeleteVolume)) != 0 {
				t.Error("the volume the edited record names was deleted")
			}
			if legacy && w.claim("data") == nil {
				t.Error("the claim lost the finalizer nobody checked")
			}
		})
	}
}

// A clone or a restore keeps its source protected until its volume is known: the record of
// a deleted claim, left by a dead leader, keeps the source's finalizer on until the undo
// has found and deleted the volume.
func TestASourceStaysProtectedUntilTheUndoOfItsCloneOrRestoreIsDone(t *testing.T) {
	for _, kind := range []string{"clone", "restore"} {
		t.Run(kind, func(t *testing.T) {
			caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CLONE_VOLUME, csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)
			snaps := snapfake.NewSimpleClientset()
			src, srcPV := boundSource()
			var protected func() bool
			var w *servedWorld
			w = newServedWorld(t, testdriver.Config{ControllerCapabilities: caps, MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 300 * time.Millisecond}},
				func(c *config) {
					// The dead leader's world: the source, protected, and the deleted claim
					// whose volume it was making from it.
					c.snapshotClient = noWatchList{snaps}
					ctx := context.Background()
					vol, err := c.csi.CreateVolume(ctx, objects.CreateVolumeRequest("source"))
					if err != nil {
						t.Fatal(err)
					}
					req := objects.CreateVolumeRequest("pvc-uid-dst")
					claim := claimFor("dst", "uid-dst", "fast")
					switch kind {
					case "clone":
						srcPV.Spec.CSI.VolumeHandle = vol.GetVolume().GetVolumeId()
						src.Finalizers = []string{request.CloneProtectionFinalizer}
						claim.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: request.PVCKind, Name: "src"}
						req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: vol.GetVolume().GetVolumeId()}}}
						protected = func() bool {
							c := w.claim("src")
							return c != nil && slices.Contains(c.Finalizers, request.CloneProtectionFinalizer)
						}
					case "restore":
						made, err := c.csi.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: vol.GetVolume().GetVolumeId(), Name: "snap"})
						if err != nil {
							t.Fatal(err)
						}
						snap, content := snapshotOf("snap", drv, request.SnapshotProtectionFinalizer)
						content.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: ptr.To(made.GetSnapshot().GetSnapshotId())}
						if err := snaps.Tracker().Add(snap); err != nil {
							t.Fatal(err)
						}
						if err := snaps.Tracker().Add(content); err != nil {
							t.Fatal(err)
						}
						claim.Spec.DataSource = &v1.TypedLocalObjectReference{APIGroup: ptr.To(request.SnapshotAPIGroup), Kind: request.SnapshotKind, Name: "snap"}
						req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: made.GetSnapshot().GetSnapshotId()}}}
						protected = func() bool {
							s, err := snaps.SnapshotV1().VolumeSnapshots("ns").Get(context.Background(), "snap", metav1.GetOptions{})
							return err == nil && slices.Contains(s.Finalizers, request.SnapshotProtectionFinalizer)
						}
					}
					rec, err := record.New(drv, "", nil, req)
					if err != nil {
						t.Fatal(err)
					}
					rec.Source = request.SourceRef{Kind: request.SourceClone, Namespace: "ns", Name: "src"}.Key()
					if kind == "restore" {
						rec.Source = request.SourceRef{Kind: request.SourceSnapshot, Namespace: "ns", Name: "snap"}.Key()
					}
					// The claim is gone: only its record is left.
					for _, o := range []runtime.Object{src, srcPV, deadLeaderRecord(t, claim, rec)} {
						if err := c.kube.(*fake.Clientset).Tracker().Add(o); err != nil {
							t.Fatal(err)
						}
					}
				}, class("fast", nil))
			w.waitFor("the undo's CreateVolume running", func() bool {
				for _, c := range w.calls(testdriver.MethodCreateVolume) {
					if c.VolumeName == "pvc-uid-dst" {
						return true
					}
				}
				return false
			})
			if !protected() {
				t.Fatal("the source lost its finalizer while the volume made from it was being found")
			}
			w.waitFor("the record closed", func() bool { return w.record("uid-dst") == nil })
			w.waitFor("the source's finalizer gone", func() bool { return !protected() })
			for _, v := range w.driver.Volumes() {
				if v.Name == "pvc-uid-dst" {
					t.Errorf("volume %s made from the source is still in the driver", v.ID)
				}
			}
		})
	}
}

// A driver that cannot answer an undo for a while shows it on the claim (an event each
// time), never as silence, and the record closes as soon as the volume is known deleted.
func TestAStuckUndoShowsOnTheClaimUntilTheVolumeIsKnownDeleted(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fault testdriver.Fault
		// made: the dead leader's CreateVolume made the volume.
		made bool
		want string
	}{
		{name: "DeleteVolume fails", made: true, fault: testdriver.Fault{Method: testdriver.MethodDeleteVolume, Code: codes.Internal, Times: 3}, want: "DeleteVolume"},
		{name: "CreateVolume does not answer", made: true, fault: testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: codes.Unavailable, Times: 3}, want: "Unavailable"},
		{name: "CreateVolume's answer is lost, the volume made", fault: testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: codes.DeadlineExceeded, Times: 3, ApplyAnyway: true}, want: "DeadlineExceeded"},
		{name: "the name is taken by a volume made otherwise", made: true, fault: testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: codes.AlreadyExists, Times: 3}, want: "other parameters"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newHeldServedWorld(t, testdriver.Config{}, nil, class("fast", nil))
			req := objects.CreateVolumeRequest("pvc-uid-1")
			req.Secrets = nil
			if tc.made {
				if _, err := w.ctrl.csi.CreateVolume(context.Background(), req); err != nil {
					t.Fatal(err)
				}
			}
			if err := w.driver.InjectFault(tc.fault); err != nil {
				t.Fatal(err)
			}
			rec, err := record.New(drv, "", nil, req)
			if err != nil {
				t.Fatal(err)
			}
			w.startWith(deadLeaderRecord(t, claimFor("data", "uid-1", "fast"), rec))
			w.waitFor("the record closed", func() bool { return w.record("uid-1") == nil })
			if n := len(w.driver.Volumes()); n != 0 {
				t.Errorf("%d volumes left in the driver", n)
			}
			failed := 0
			for _, e := range w.events() {
				if strings.Contains(e, reasonUndoFailed) && strings.Contains(e, tc.want) {
					failed++
				}
			}
			if failed != tc.fault.Times {
				t.Errorf("%d %s events saying %q, want one per failed attempt (%d)", failed, reasonUndoFailed, tc.want, tc.fault.Times)
			}
		})
	}
}

// A record whose closing event this process still owes was superseded by the
// PersistentVolume it saved: when that PersistentVolume and the claim are gone before the
// closer wrote the event (a busy budget serves it last), the record is closed, not undone:
// no CreateVolume of a volume deleted already.
func TestARecordWaitingForItsClosingEventIsNeverUndone(t *testing.T) {
	w := newHeldServedWorld(t, testdriver.Config{}, nil, class("fast", nil))
	claim := claimFor("data", "uid-1", "fast")
	rec, err := record.New(drv, "", nil, objects.CreateVolumeRequest("pvc-uid-1"))
	if err != nil {
		t.Fatal(err)
	}
	w.create(deadLeaderRecord(t, claim, rec))
	w.waitFor("the record in the cache", func() bool { return w.ctrl.records.IsOpen("uid-1") })
	// Saved here, closing owed; the claim and the PersistentVolume gone since.
	w.ctrl.closer.Later("uid-1", record.ClaimReference(claim), rec.Volume)
	if err := w.ctrl.syncClaim("uid-1"); err != nil {
		t.Fatal(err)
	}
	if n := len(w.calls(testdriver.MethodCreateVolume)) + len(w.calls(testdriver.MethodDeleteVolume)); n != 0 {
		t.Errorf("%d CreateVolume/DeleteVolume calls for a record a saved PersistentVolume superseded, want none", n)
	}
	w.start()
	w.waitFor("the record closed", func() bool { return w.record("uid-1") == nil })
}

// A new leader acts on each record of a batch a dead leader wrote in one event (records
// that waited together for the budget): the claim still there gets its volume, the deleted
// one's volume is deleted, and each record closes on its own.
func TestANewLeaderActsOnEachRecordOfABatch(t *testing.T) {
	sc := class("fast", nil)
	w := newHeldServedWorld(t, testdriver.Config{}, nil, sc)
	kept, gone := claimFor("kept", "uid-1", "fast"), claimFor("gone", "uid-2", "fast")
	var records []record.Carried
	for _, claim := range []*v1.PersistentVolumeClaim{kept, gone} {
		p, err := w.ctrl.planner.plan(claim, sc)
		if err != nil {
			t.Fatal(err)
		}
		rec, err := record.New(drv, "", p.pv.secrets.Provisioner, p.req)
		if err != nil {
			t.Fatal(err)
		}
		value, err := rec.Encode()
		if err != nil {
			t.Fatal(err)
		}
		records = append(records, record.Carried{Claim: record.ClaimReference(claim), Record: value})
		// The dead leader's CreateVolume made both volumes.
		if _, err := w.ctrl.csi.CreateVolume(context.Background(), p.req); err != nil {
			t.Fatal(err)
		}
	}
	first, err := record.Decode(records[0].Record)
	if err != nil {
		t.Fatal(err)
	}
	batch := deadLeaderRecord(t, kept, first)
	also, err := json.Marshal(records[1:])
	if err != nil {
		t.Fatal(err)
	}
	batch.Annotations[record.AnnAlso] = string(also)

	w.startWith(kept, batch) // the claim "gone" was deleted while nobody led
	w.waitFor("the kept claim's PersistentVolume, the other's volume deleted, both records closed", func() bool {
		return w.pv("pvc-uid-1") != nil && len(w.driver.Volumes()) == 1 &&
			!w.recordOpen("uid-1", "kept") && !w.recordOpen("uid-2", "gone")
	})
	if vols := w.driver.Volumes(); vols[0].ID != w.pv("pvc-uid-1").Spec.CSI.VolumeHandle {
		t.Errorf("volume %s left, want the kept claim's %s", vols[0].ID, w.pv("pvc-uid-1").Spec.CSI.VolumeHandle)
	}
	if deletes := w.calls(testdriver.MethodDeleteVolume); len(deletes) != 1 {
		t.Errorf("%d DeleteVolume calls, want 1 (the deleted claim's volume)", len(deletes))
	}
	if w.pv("pvc-uid-2") != nil {
		t.Error("the deleted claim got a PersistentVolume")
	}
}
