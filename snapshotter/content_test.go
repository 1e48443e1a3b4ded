package snapshotter

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	snapinformers "github.com/kubernetes-csi/external-snapshotter/client/v8/informers/externalversions"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
)

// fakeController answers the snapshot calls and records them; the test's actions on the
// clientset and the calls interleave in one log, so the order of writes and calls shows.
type fakeController struct {
	csi.ControllerClient
	mu      sync.Mutex
	log     *[]string
	created map[string]*csi.Snapshot
	// ready is what the calls report.
	ready   bool
	secrets []map[string]string
	params  []map[string]string

	// createErr, deleteErr and listErr, when set, are what CreateSnapshot, DeleteSnapshot
	// and ListSnapshots answer.
	createErr, deleteErr, listErr error
}

func (f *fakeController) note(s string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	*f.log = append(*f.log, s)
}

func (f *fakeController) CreateSnapshot(_ context.Context, req *csi.CreateSnapshotRequest, _ ...grpc.CallOption) (*csi.CreateSnapshotResponse, error) {
	f.note("CreateSnapshot " + req.Name)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.secrets = append(f.secrets, req.Secrets)
	f.params = append(f.params, req.Parameters)
	if f.createErr != nil {
		return nil, f.createErr
	}
	s := &csi.Snapshot{SnapshotId: "id-" + req.Name, SourceVolumeId: req.SourceVolumeId, SizeBytes: 1 << 20,
		CreationTime: timestamppb.New(time.Unix(1000, 0)), ReadyToUse: f.ready}
	f.created[s.SnapshotId] = s
	return &csi.CreateSnapshotResponse{Snapshot: s}, nil
}

func (f *fakeController) DeleteSnapshot(_ context.Context, req *csi.DeleteSnapshotRequest, _ ...grpc.CallOption) (*csi.DeleteSnapshotResponse, error) {
	f.note("DeleteSnapshot " + req.SnapshotId)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.secrets = append(f.secrets, req.Secrets)
	if f.deleteErr != nil {
		return nil, f.deleteErr
	}
	delete(f.created, req.SnapshotId)
	return &csi.DeleteSnapshotResponse{}, nil
}

func (f *fakeController) ListSnapshots(_ context.Context, req *csi.ListSnapshotsRequest, _ ...grpc.CallOption) (*csi.ListSnapshotsResponse, error) {
	f.note("ListSnapshots " + req.SnapshotId)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.secrets = append(f.secrets, req.Secrets)
	if f.listErr != nil {
		return nil, f.listErr
	}
	return &csi.ListSnapshotsResponse{Entries: []*csi.ListSnapshotsResponse_Entry{{Snapshot: &csi.Snapshot{
		SnapshotId: req.SnapshotId, SizeBytes: 5 << 20, ReadyToUse: f.ready, CreationTime: timestamppb.New(time.Unix(2000, 0))}}}}, nil
}

type world struct {
	t      *testing.T
	snap   *snapfake.Clientset
	kube   *kubefake.Clientset
	ctrl   *contentController
	driver *fakeController
	events *record.FakeRecorder
	log    []string
}

const testDriver = "snap.test.csi"

func newWorld(t *testing.T, objs ...*snapv1.VolumeSnapshotContent) *world {
	t.Helper()
	w := &world{t: t, kube: kubefake.NewClientset(&v1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "creds"}, Data: map[string][]byte{"password": []byte("s3cret")}})}
	class := &snapv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: "class"}, Driver: testDriver,
		DeletionPolicy: snapv1.VolumeSnapshotContentDelete, Parameters: map[string]string{"speed": "fast",
			paramListSecretName: "creds", paramListSecretNamespace: "ns"}}
	w.snap = snapfake.NewSimpleClientset(class)
	for _, o := range objs {
		if _, err := w.snap.SnapshotV1().VolumeSnapshotContents().Create(context.Background(), o, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	w.snap.PrependReactor("*", "volumesnapshotcontents", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetVerb() == "patch" {
			p := a.(k8stesting.PatchAction)
			w.log = append(w.log, "patch "+p.GetSubresource()+" "+string(p.GetPatch()))
		}
		return false, nil, nil
	})
	w.driver = &fakeController{log: &w.log, created: map[string]*csi.Snapshot{}, ready: true}
	factory := snapinformers.NewSharedInformerFactory(noWatchList{w.snap}, 0)
	listAndWatch(factory, w.snap)
	w.events = record.NewFakeRecorder(10)
	ctrl, err := newContentController(controllerConfig{
		clients:    &clients{snap: noWatchList{w.snap}, kube: w.kube, contentFactory: factory, classFactory: factory},
		driver:     &driver{name: testDriver, ctrl: w.driver, timeout: time.Minute, lists: true},
		recorder:   w.events,
		retryStart: time.Millisecond, retryMax: time.Second,
		namePrefix: "snapshot", nameUUIDSize: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	w.ctrl = ctrl
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	factory.Start(stop)
	cache.WaitForCacheSync(stop, ctrl.synced...)
	return w
}

// sync runs one sync of the content, as a worker of a leader would.
func (w *world) sync(name string) error {
	w.t.Helper()
	ctx := context.Background()
	return w.ctrl.step(ctx, ctx, name, w.ctrl.sync)
}

func (w *world) content(name string) *snapv1.VolumeSnapshotContent {
	w.t.Helper()
	c, err := w.snap.SnapshotV1().VolumeSnapshotContents().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return c
}

func dynamicContent(name string) *snapv1.VolumeSnapshotContent {
	vol, class := "vol-1", "class"
	return &snapv1.VolumeSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: []string{contentFinalizer},
			Annotations: map[string]string{annDeletionSecretName: "creds", annDeletionSecretNamespace: "ns"}},
		Spec: snapv1.VolumeSnapshotContentSpec{
			Driver: testDriver, DeletionPolicy: snapv1.VolumeSnapshotContentDelete, VolumeSnapshotClassName: &class,
			Source:            snapv1.VolumeSnapshotContentSource{VolumeHandle: &vol},
			VolumeSnapshotRef: v1.ObjectReference{Namespace: "ns", Name: "snap", UID: types.UID("uid-1")},
		},
	}
}

// The record goes on before CreateSnapshot; the result is on the status before the record
// goes: whatever crashes in between, a snapshot the driver took is found again.
func TestCreateRecordsBeforeTheCallAndTheResultBeforeClearingIt(t *testing.T) {
	w := newWorld(t, dynamicContent("c1"))
	if err := w.sync("c1"); err != nil {
		t.Fatal(err)
	}
	want := []string{
		`patch  {"metadata":{"annotations":{"snapshot.storage.kubernetes.io/volumesnapshot-being-created":"yes"}}}`,
		"CreateSnapshot snapshot-uid-1",
		`patch status {"status":{"creationTime":1000000000000,"readyToUse":true,"restoreSize":1048576,"snapshotHandle":"id-snapshot-uid-1"}}`,
		`patch  {"metadata":{"annotations":{"snapshot.storage.kubernetes.io/volumesnapshot-being-created":null}}}`,
	}
	if !slices.Equal(w.log, want) {
		t.Errorf("writes and calls:\n%q\nwant\n%q", w.log, want)
	}
	c := w.content("c1")
	if _, ok := c.Annotations[annBeingCreated]; ok || !isReady(c) || *c.Status.SnapshotHandle != "id-snapshot-uid-1" {
		t.Errorf("content after create: annotations %v status %+v", c.Annotations, c.Status)
	}
	if got := w.driver.secrets[0]["password"]; got != "s3cret" {
		t.Errorf("CreateSnapshot got secret %q, want the content's snapshotter secret", got)
	}
	if got := w.driver.params[0]; len(got) != 1 || got["speed"] != "fast" {
		t.Errorf("CreateSnapshot parameters %v, want the class's without its secret keys", got)
	}
}

// A failure the driver may still be working on (a timeout) keeps the record; a final one
// lets it go. Both land on the status and as an event.
func TestCreateFailuresKeepTheRecordOnlyWhileTheCallMayRun(t *testing.T) {
	for _, c := range []struct {
		code       codes.Code
		keepRecord bool
	}{{codes.DeadlineExceeded, true}, {codes.InvalidArgument, false}} {
		w := newWorld(t, dynamicContent("c1"))
		w.driver.createErr = status.Error(c.code, "no")
		if err := w.sync("c1"); err == nil {
			t.Fatalf("%v: sync succeeded", c.code)
		}
		got := w.content("c1")
		if _, ok := got.Annotations[annBeingCreated]; ok != c.keepRecord {
			t.Errorf("%v: record kept %v, want %v", c.code, ok, c.keepRecord)
		}
		if got.Status == nil || got.Status.Error == nil || got.Status.ReadyToUse == nil || *got.Status.ReadyToUse {
			t.Errorf("%v: status %+v, want an error", c.code, got.Status)
		}
		select {
		case e := <-w.events.Events:
			if e[:len("Warning SnapshotCreationFailed")] != "Warning SnapshotCreationFailed" {
				t.Errorf("%v: event %q", c.code, e)
			}
		default:
			t.Errorf("%v: no event", c.code)
		}
	}
}

// A VolumeSnapshot deleted while its snapshot is taken (upstream's issue 1388): nothing is
// deleted while the record is on; once the result is recorded the snapshot is deleted.
func TestDeletionWaitsForTheRecordThenDeletes(t *testing.T) {
	c := dynamicContent("c1")
	now := metav1.Now()
	c.DeletionTimestamp = &now
	c.Annotations[annBeingCreated] = "yes"
	c.Annotations[annBeingDeleted] = "yes"
	w := newWorld(t, c)
	if err := w.sync("c1"); err != nil {
		t.Fatal(err)
	}
	if slices.ContainsFunc(w.log, func(s string) bool { return s[:6] == "Delete" }) {
		t.Fatalf("deleted while the record was on: %q", w.log)
	}
	if len(w.driver.created) != 1 {
		t.Fatalf("CreateSnapshot not finished: %q", w.log)
	}
	// The create requeued the content; the next sync deletes. (The fake clientset keeps no
	// resourceVersions, so the cache is read once the informer shows the writes.)
	if w.ctrl.queue.Len() != 1 {
		t.Errorf("content not requeued after its snapshot was recorded")
	}
	waitFor(t, func() bool {
		c, _, _ := w.ctrl.own.Get("c1")
		_, creating := c.Annotations[annBeingCreated]
		return isReady(c) && !creating
	})
	if err := w.sync("c1"); err != nil {
		t.Fatal(err)
	}
	if len(w.driver.created) != 0 {
		t.Errorf("snapshot not deleted: %q", w.log)
	}
	got := w.content("c1")
	if slices.Contains(got.Finalizers, contentFinalizer) {
		t.Errorf("finalizer still on: %v", got.Finalizers)
	}
	// A repeated sync (a conflict, a resync) does not call the driver again.
	deletes := 0
	for _, l := range w.log {
		if l[:6] == "Delete" {
			deletes++
		}
	}
	if deletes != 1 {
		t.Errorf("%d DeleteSnapshot calls, want 1", deletes)
	}
	// One write per deletion: the finalizer (upstream also clears the status first).
	after := w.log[slices.IndexFunc(w.log, func(l string) bool { return strings.HasPrefix(l, "DeleteSnapshot") })+1:]
	if len(after) != 1 || !strings.Contains(after[0], `"op":"remove","path":"/metadata/finalizers/0"`) {
		t.Errorf("writes after DeleteSnapshot: %q, want the finalizer's removal only", after)
	}
}

// A content being deleted without the snapshot-controller's agreement keeps its snapshot.
func TestDeletionWaitsForTheSnapshotController(t *testing.T) {
	c := dynamicContent("c1")
	now := metav1.Now()
	c.DeletionTimestamp = &now
	ready, handle := true, "id-x"
	c.Status = &snapv1.VolumeSnapshotContentStatus{ReadyToUse: &ready, SnapshotHandle: &handle}
	w := newWorld(t, c)
	if err := w.sync("c1"); err != nil {
		t.Fatal(err)
	}
	if len(w.log) != 0 {
		t.Errorf("acted without the being-deleted annotation: %q", w.log)
	}
}

// preProvisionedContent is a content of the backend's snapshot handle, of class "class",
// not checked yet.
func preProvisionedContent(name, handle string) *snapv1.VolumeSnapshotContent {
	class := "class"
	return &snapv1.VolumeSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: snapv1.VolumeSnapshotContentSpec{Driver: testDriver, DeletionPolicy: snapv1.VolumeSnapshotContentRetain,
			VolumeSnapshotClassName: &class, Source: snapv1.VolumeSnapshotContentSource{SnapshotHandle: &handle},
			VolumeSnapshotRef: v1.ObjectReference{Namespace: "ns", Name: "snap"}},
	}
}

// A pre-provisioned content is checked with ListSnapshots and the class's list secret.
func TestPreProvisionedContentIsCheckedWithTheListSecret(t *testing.T) {
	handle := "backend-snap"
	w := newWorld(t, preProvisionedContent("pre", handle))
	if err := w.sync("pre"); err != nil {
		t.Fatal(err)
	}
	got := w.content("pre")
	if !isReady(got) || *got.Status.SnapshotHandle != handle || *got.Status.RestoreSize != 5<<20 {
		t.Errorf("status %+v", got.Status)
	}
	if w.driver.secrets[0]["password"] != "s3cret" {
		t.Errorf("ListSnapshots secrets %v, want the list secret", len(w.driver.secrets[0]))
	}
}

// A snapshot not ready yet is requeued with backoff, and asked again with CreateSnapshot.
func TestNotReadyIsPolled(t *testing.T) {
	w := newWorld(t, dynamicContent("c1"))
	w.driver.ready = false
	if err := w.sync("c1"); !errors.Is(err, errPending) {
		t.Fatalf("sync: %v, want errPending", err)
	}
	w.driver.ready = true
	waitFor(t, func() bool {
		c, _, _ := w.ctrl.own.Get("c1")
		_, creating := c.Annotations[annBeingCreated]
		return c.Status != nil && !creating
	})
	if err := w.sync("c1"); err != nil {
		t.Fatal(err)
	}
	if !isReady(w.content("c1")) {
		t.Errorf("not ready after the second CreateSnapshot: %q", w.log)
	}
	// The snapshot's handle is on the status after the first answer: asking again needs no
	// being-created record (one write less per poll than upstream).
	marks := 0
	for _, l := range w.log {
		if strings.Contains(l, `volumesnapshot-being-created":"yes"`) {
			marks++
		}
	}
	if marks != 1 {
		t.Errorf("%d being-created writes, want 1 (before the first call only): %q", marks, w.log)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// noWatchList makes informers list and watch the fake clientset, which cannot stream a
// watch list.
type noWatchList struct{ *snapfake.Clientset }

func (noWatchList) IsWatchListSemanticsUnSupported() bool { return true }

// listAndWatch registers the factory's content and class informers over plain list and
// watch (the generated informers would ask the fake for a watch list it cannot stream).
func listAndWatch(factory snapinformers.SharedInformerFactory, client *snapfake.Clientset) {
	factory.InformerFor(&snapv1.VolumeSnapshotContent{}, func(_ snapclientset.Interface, _ time.Duration) cache.SharedIndexInformer {
		lw := cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
			ListFunc: func(o metav1.ListOptions) (runtime.Object, error) {
				return client.SnapshotV1().VolumeSnapshotContents().List(context.Background(), o)
			},
			WatchFunc: func(o metav1.ListOptions) (watch.Interface, error) {
				return client.SnapshotV1().VolumeSnapshotContents().Watch(context.Background(), o)
			},
		}, noWatchList{client})
		return cache.NewSharedIndexInformer(lw, &snapv1.VolumeSnapshotContent{}, 0, cache.Indexers{})
	})
	factory.InformerFor(&snapv1.VolumeSnapshotClass{}, func(_ snapclientset.Interface, _ time.Duration) cache.SharedIndexInformer {
		lw := cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
			ListFunc: func(o metav1.ListOptions) (runtime.Object, error) {
				return client.SnapshotV1().VolumeSnapshotClasses().List(context.Background(), o)
			},
			WatchFunc: func(o metav1.ListOptions) (watch.Interface, error) {
				return client.SnapshotV1().VolumeSnapshotClasses().Watch(context.Background(), o)
			},
		}, noWatchList{client})
		return cache.NewSharedIndexInformer(lw, &snapv1.VolumeSnapshotClass{}, 0, cache.Indexers{})
	})
}

// A group member's status comes from the snapshot-controller, first and whenever it syncs
// the group: a member it leaves not ready is checked then, not at the next resync. Other
// status changes are the sidecar's own and need no sync.
func TestAGroupMembersFirstStatusWakesIt(t *testing.T) {
	member := dynamicContent("m")
	member.ResourceVersion = "1"
	member.Annotations[annGroupMember] = "group-1"
	recorded := member.DeepCopy()
	recorded.ResourceVersion = "2"
	handle, ready := "snap-1", false
	recorded.Status = &snapv1.VolumeSnapshotContentStatus{SnapshotHandle: &handle, ReadyToUse: &ready}
	if !changed(member, recorded, contentRules()) {
		t.Error("a group member's first status does not wake it")
	}
	// The sidecar found it ready; the snapshot-controller wrote the group's stale answer.
	readyNow, stale := recorded.DeepCopy(), recorded.DeepCopy()
	readyNow.ResourceVersion, stale.ResourceVersion = "3", "4"
	readyNow.Status.ReadyToUse = new(true)
	if !changed(readyNow, stale, contentRules()) {
		t.Error("a group member set back to not ready does not wake it")
	}
	if changed(recorded, readyNow, contentRules()) != true {
		t.Error("turning ready must wake a content (upstream's issue 1388)")
	}
	plain := dynamicContent("p")
	plain.ResourceVersion = "1"
	withStatus := plain.DeepCopy()
	withStatus.ResourceVersion = "2"
	withStatus.Status = recorded.Status
	if changed(plain, withStatus, contentRules()) {
		t.Error("the sidecar's own status write wakes a content that is no group member")
	}
}
