package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	snapinformers "github.com/kubernetes-csi/external-snapshotter/client/v8/informers/externalversions"
	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cachetest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

const groupTestDriver = "group.csi.test"

var groupContentsGVR = groupv1.SchemeGroupVersion.WithResource("volumegroupsnapshotcontents")

// groupFixture is one group controller over a fake API server and the test CSI driver (its
// GroupController service) on a UNIX socket. Tests call sync directly, as a worker would.
type groupFixture struct {
	t        *testing.T
	snap     *snapfake.Clientset
	kube     *kubefake.Clientset
	versions *groupVersions
	factory  snapinformers.SharedInformerFactory
	driver   *testdriver.Backend
	ctrl     csi.ControllerClient
	recorder *record.FakeRecorder
	g        *groupController

	mu sync.Mutex
	// patches are the writes of group contents, in order, each with the number of
	// CreateVolumeGroupSnapshot calls the driver had received when it was sent.
	patches []groupPatch
}

type groupPatch struct {
	subresource string
	body        string
	creates     int
}

func newGroupFixture(t *testing.T, cfg testdriver.Config) *groupFixture {
	t.Helper()
	cfg.DriverName = groupTestDriver
	cfg.ControllerCapabilities = append(testdriver.DefaultControllerCapabilities(),
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT, csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS)
	d, err := testdriver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	conn := testdriver.Dial(t, d)
	snap := snapfake.NewSimpleClientset()
	versions := &groupVersions{ObjectTracker: snap.Tracker()}
	snap.PrependReactor("*", "*", k8stesting.ObjectReaction(versions))
	f := &groupFixture{
		t: t, snap: snap, kube: kubefake.NewClientset(), versions: versions, driver: d,
		ctrl:     csi.NewControllerClient(conn),
		factory:  snapinformers.NewSharedInformerFactoryWithOptions(snap, 0, snapinformers.WithTransform(cachetest.Transform())),
		recorder: record.NewFakeRecorder(100),
	}
	// Runs before the tracker's reaction (prepended last), and leaves the patch to it.
	snap.PrependReactor("patch", "volumegroupsnapshotcontents", func(a k8stesting.Action) (bool, runtime.Object, error) {
		p := a.(k8stesting.PatchAction)
		f.mu.Lock()
		defer f.mu.Unlock()
		f.patches = append(f.patches, groupPatch{subresource: p.GetSubresource(), body: string(p.GetPatch()),
			creates: len(d.Calls(testdriver.MethodCreateVolumeGroupSnapshot))})
		return false, nil, nil
	})
	f.g, err = newGroupController(controllerConfig{
		clients:  &clients{snap: snap, kube: f.kube, contentFactory: f.factory, classFactory: f.factory},
		driver:   &driver{name: groupTestDriver, group: csi.NewGroupControllerClient(conn), timeout: 10 * time.Second},
		recorder: f.recorder, retryStart: time.Millisecond, retryMax: 100 * time.Millisecond,
		namePrefix: "groupsnapshot", nameUUIDSize: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// add puts objects in the fake API servers: secrets in the kube one, the rest, with
// resourceVersions, in the snapshot one.
func (f *groupFixture) add(objs ...runtime.Object) {
	f.t.Helper()
	for _, o := range objs {
		var err error
		if _, ok := o.(*v1.Secret); ok {
			err = f.kube.Tracker().Add(o)
		} else {
			err = f.versions.Add(o)
		}
		if err != nil {
			f.t.Fatal(err)
		}
	}
}

// start starts the informers and waits for their caches.
func (f *groupFixture) start() {
	f.t.Helper()
	stop := make(chan struct{})
	f.t.Cleanup(func() { close(stop) })
	f.factory.Start(stop)
	for typ, ok := range f.factory.WaitForCacheSync(stop) {
		if !ok {
			f.t.Fatalf("cache of %v not synced", typ)
		}
	}
}

func (f *groupFixture) sync(name string) error {
	return f.g.step(context.Background(), context.Background(), name, f.g.sync)
}

// stored is the group content as the fake API server has it.
func (f *groupFixture) stored(name string) *groupv1.VolumeGroupSnapshotContent {
	f.t.Helper()
	obj, err := f.versions.Get(groupContentsGVR, "", name)
	if err != nil {
		f.t.Fatal(err)
	}
	return obj.(*groupv1.VolumeGroupSnapshotContent)
}

// waitCached waits until the controller's cache shows the group content as ok wants it.
func (f *groupFixture) waitCached(name string, ok func(*groupv1.VolumeGroupSnapshotContent) bool) {
	f.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, exists, err := f.g.own.Get(name)
		if err == nil && exists && ok(c) {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("group content %s not cached as expected: %+v", name, c)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// volume creates a backend volume and returns its id.
func (f *groupFixture) volume(name string) string {
	f.t.Helper()
	rsp, err := f.ctrl.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name:          name,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}},
	})
	if err != nil {
		f.t.Fatal(err)
	}
	return rsp.GetVolume().GetVolumeId()
}

func (f *groupFixture) writes() []groupPatch {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.patches)
}

// events drains the events recorded so far.
func (f *groupFixture) events() []string {
	var out []string
	for {
		select {
		case e := <-f.recorder.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

// groupVersions gives the fake API server what the controller relies on and the fake
// tracker leaves out: every write sets a new, increasing resourceVersion on the object.
type groupVersions struct {
	k8stesting.ObjectTracker
	mu      sync.Mutex
	version int
}

func (t *groupVersions) stamp(obj runtime.Object) error {
	m, err := meta.Accessor(obj)
	if err != nil {
		return err
	}
	t.version++
	m.SetResourceVersion(strconv.Itoa(t.version))
	return nil
}

func (t *groupVersions) Add(obj runtime.Object) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	obj = obj.DeepCopyObject()
	if err := t.stamp(obj); err != nil {
		return err
	}
	return t.ObjectTracker.Add(obj)
}

func (t *groupVersions) Create(gvr schema.GroupVersionResource, obj runtime.Object, ns string, opts ...metav1.CreateOptions) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.stamp(obj); err != nil {
		return err
	}
	return t.ObjectTracker.Create(gvr, obj, ns, opts...)
}

func (t *groupVersions) Update(gvr schema.GroupVersionResource, obj runtime.Object, ns string, opts ...metav1.UpdateOptions) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.stamp(obj); err != nil {
		return err
	}
	return t.ObjectTracker.Update(gvr, obj, ns, opts...)
}

func (t *groupVersions) Patch(gvr schema.GroupVersionResource, obj runtime.Object, ns string, opts ...metav1.PatchOptions) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.stamp(obj); err != nil {
		return err
	}
	return t.ObjectTracker.Patch(gvr, obj, ns, opts...)
}

const (
	groupTestClass  = "group-class"
	groupTestSecret = "group-secret"
)

func groupClass(name, driver string, params map[string]string) *groupv1.VolumeGroupSnapshotClass {
	return &groupv1.VolumeGroupSnapshotClass{
		ObjectMeta:     metav1.ObjectMeta{Name: name},
		Driver:         driver,
		Parameters:     params,
		DeletionPolicy: snapv1.VolumeSnapshotContentDelete,
	}
}

func groupSecret(name string, keys ...string) *v1.Secret {
	s := &v1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name}, Data: map[string][]byte{}}
	for _, k := range keys {
		s.Data[k] = []byte("value-of-" + k)
	}
	return s
}

// dynamicGroupContent is a group content as the snapshot-controller makes it for a new
// VolumeGroupSnapshot of volumes.
func dynamicGroupContent(name string, volumes ...string) *groupv1.VolumeGroupSnapshotContent {
	class := groupTestClass
	return &groupv1.VolumeGroupSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, UID: types.UID("uid-" + name),
			Finalizers: []string{groupFinalizer},
			Annotations: map[string]string{
				annGroupSecretName:      groupTestSecret,
				annGroupSecretNamespace: "default",
			},
		},
		Spec: groupv1.VolumeGroupSnapshotContentSpec{
			VolumeGroupSnapshotRef:       v1.ObjectReference{Kind: "VolumeGroupSnapshot", Namespace: "ns", Name: "vgs-" + name, UID: types.UID("vgs-uid-" + name)},
			DeletionPolicy:               snapv1.VolumeSnapshotContentDelete,
			Driver:                       groupTestDriver,
			VolumeGroupSnapshotClassName: &class,
			Source:                       groupv1.VolumeGroupSnapshotContentSource{VolumeHandles: volumes},
		},
	}
}

func hasAnnotation(c *groupv1.VolumeGroupSnapshotContent, key string) bool {
	_, ok := c.Annotations[key]
	return ok
}

func TestGroupCreateRecordsStatusAndMembers(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{})
	v1ID, v2ID := f.volume("pv-1"), f.volume("pv-2")
	content := dynamicGroupContent("gc-1", v1ID, v2ID)
	f.add(content,
		groupClass(groupTestClass, groupTestDriver, map[string]string{
			"tier":                               "gold",
			paramGroupSnapshotterSecretName:      groupTestSecret,
			paramGroupSnapshotterSecretNamespace: "default",
		}),
		groupSecret(groupTestSecret, "token"))
	f.g.extraCreate = true
	f.start()

	if err := f.sync("gc-1"); err != nil {
		t.Fatalf("sync: %v", err)
	}

	creates := f.driver.Calls(testdriver.MethodCreateVolumeGroupSnapshot)
	if len(creates) != 1 {
		t.Fatalf("CreateVolumeGroupSnapshot calls: %+v", creates)
	}
	c := creates[0]
	if want := "groupsnapshot-vgs-uid-gc-1"; c.GroupSnapshotName != want {
		t.Errorf("name %q, want %q (prefix and the VolumeGroupSnapshot's UID)", c.GroupSnapshotName, want)
	}
	if got := c.SourceVolumeIDList(); !slices.Equal(got, []string{v1ID, v2ID}) {
		t.Errorf("source volumes %v", got)
	}
	if got := c.SecretKeyList(); !slices.Equal(got, []string{"token"}) {
		t.Errorf("secret keys %v, want the group snapshotter secret's", got)
	}
	groups := f.driver.GroupSnapshots()
	if len(groups) != 1 {
		t.Fatalf("backend group snapshots: %+v", groups)
	}
	wantParams := map[string]string{
		"tier":                 "gold",
		paramGroupSnapshotName: "vgs-gc-1",
		paramGroupSnapshotNS:   "ns",
		paramGroupContentName:  "gc-1",
	}
	if !maps.Equal(groups[0].Parameters, wantParams) {
		t.Errorf("parameters %v, want %v (class parameters without secret keys, and the extra metadata)", groups[0].Parameters, wantParams)
	}

	got := f.stored("gc-1")
	st := got.Status
	switch {
	case st == nil:
		t.Fatal("no status recorded")
	case st.VolumeGroupSnapshotHandle == nil || *st.VolumeGroupSnapshotHandle != groups[0].ID:
		t.Errorf("group handle %v, want %s", st.VolumeGroupSnapshotHandle, groups[0].ID)
	case st.ReadyToUse == nil || !*st.ReadyToUse:
		t.Errorf("readyToUse %v, want true", st.ReadyToUse)
	case st.CreationTime == nil || st.CreationTime.Unix() != groups[0].CreationTime.Unix():
		t.Errorf("creationTime %v, want %v", st.CreationTime, groups[0].CreationTime)
	case st.Error != nil:
		t.Errorf("error recorded: %+v", st.Error)
	}
	if len(st.VolumeSnapshotInfoList) != 2 {
		t.Fatalf("members %+v", st.VolumeSnapshotInfoList)
	}
	for i, m := range st.VolumeSnapshotInfoList {
		snap, ok := f.driver.Snapshot(groups[0].SnapshotIDs[i])
		switch {
		case !ok:
			t.Errorf("member %d: no backend snapshot", i)
		case m.SnapshotHandle != snap.ID || m.VolumeHandle != groups[0].SourceVolumeIDs[i]:
			t.Errorf("member %d: %+v, want snapshot %s of %s", i, m, snap.ID, groups[0].SourceVolumeIDs[i])
		case m.ReadyToUse == nil || !*m.ReadyToUse:
			t.Errorf("member %d: readyToUse %v", i, m.ReadyToUse)
		case m.CreationTime == nil || *m.CreationTime != snap.CreationTime.UnixNano():
			t.Errorf("member %d: creationTime %v, want %d", i, m.CreationTime, snap.CreationTime.UnixNano())
		case m.RestoreSize == nil || *m.RestoreSize != snap.SizeBytes:
			t.Errorf("member %d: restoreSize %v, want %d", i, m.RestoreSize, snap.SizeBytes)
		}
	}
	if hasAnnotation(got, annGroupBeingCreated) {
		t.Errorf("being-created annotation left on: %v", got.Annotations)
	}

	// The record went on before the call, the result and the record's removal after it.
	w := f.writes()
	if len(w) != 3 {
		t.Fatalf("writes %+v, want the record, the status, the record's removal", w)
	}
	if !strings.Contains(w[0].body, annGroupBeingCreated) || !strings.Contains(w[0].body, `"yes"`) || w[0].creates != 0 {
		t.Errorf("first write %+v, want the being-created record before any CreateVolumeGroupSnapshot", w[0])
	}
	if w[1].subresource != "status" || w[1].creates != 1 {
		t.Errorf("second write %+v, want the status after the call", w[1])
	}
	if !strings.Contains(w[2].body, annGroupBeingCreated) || !strings.Contains(w[2].body, "null") {
		t.Errorf("third write %+v, want the record's removal", w[2])
	}
	if ev := f.events(); len(ev) != 0 {
		t.Errorf("events %v", ev)
	}

	// Ready: nothing more to do.
	f.waitCached("gc-1", func(c *groupv1.VolumeGroupSnapshotContent) bool { return !hasAnnotation(c, annGroupBeingCreated) })
	if err := f.sync("gc-1"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.driver.Calls(testdriver.MethodCreateVolumeGroupSnapshot)); n != 1 {
		t.Errorf("%d CreateVolumeGroupSnapshot calls for a ready group snapshot", n)
	}
}

func TestGroupCreatePollsUntilReady(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{SnapshotReadyAfterPolls: 1})
	v1ID, v2ID := f.volume("pv-1"), f.volume("pv-2")
	f.add(dynamicGroupContent("gc-1", v1ID, v2ID), groupClass(groupTestClass, groupTestDriver, nil), groupSecret(groupTestSecret, "token"))
	f.start()

	if err := f.sync("gc-1"); !errors.Is(err, errPending) {
		t.Fatalf("sync of a group snapshot not ready: %v, want errPending", err)
	}
	got := f.stored("gc-1")
	if st := got.Status; st == nil || st.ReadyToUse == nil || *st.ReadyToUse || st.VolumeGroupSnapshotHandle == nil || len(st.VolumeSnapshotInfoList) != 2 {
		t.Fatalf("status %+v, want the handle and members, not ready", st)
	}
	if hasAnnotation(got, annGroupBeingCreated) {
		t.Error("being-created annotation left on once the result is recorded")
	}

	// Upstream polls a dynamic group snapshot by calling CreateVolumeGroupSnapshot again.
	f.waitCached("gc-1", func(c *groupv1.VolumeGroupSnapshotContent) bool { return c.Status != nil })
	if err := f.sync("gc-1"); err != nil {
		t.Fatalf("second sync: %v", err)
	}
	creates := f.driver.Calls(testdriver.MethodCreateVolumeGroupSnapshot)
	if len(creates) != 2 || creates[0].GroupSnapshotName != creates[1].GroupSnapshotName {
		t.Fatalf("CreateVolumeGroupSnapshot calls %+v, want two of one name", creates)
	}
	if n := len(f.driver.GroupSnapshots()); n != 1 {
		t.Errorf("%d group snapshots in the backend, want 1", n)
	}
	got = f.stored("gc-1")
	if st := got.Status; st.ReadyToUse == nil || !*st.ReadyToUse {
		t.Errorf("readyToUse %v after the group snapshot turned ready", st.ReadyToUse)
	}
	// As upstream, the members are recorded once, as the first answer gave them.
	if m := got.Status.VolumeSnapshotInfoList; len(m) != 2 || m[0].ReadyToUse == nil || *m[0].ReadyToUse {
		t.Errorf("members %+v, want the first answer's", m)
	}
}

func TestGroupCreateFinalErrorRemovesRecord(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{})
	v1ID, v2ID := f.volume("pv-1"), f.volume("pv-2")
	f.add(dynamicGroupContent("gc-1", v1ID, v2ID), groupClass(groupTestClass, groupTestDriver, nil), groupSecret(groupTestSecret, "token"))
	if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateVolumeGroupSnapshot, Code: codes.InvalidArgument, Message: "volumes on two pools"}); err != nil {
		t.Fatal(err)
	}
	f.start()

	if err := f.sync("gc-1"); err == nil {
		t.Fatal("sync succeeded against a failing driver")
	}
	got := f.stored("gc-1")
	if hasAnnotation(got, annGroupBeingCreated) {
		t.Error("being-created annotation kept after a final error")
	}
	want := fmt.Sprintf("Failed to create group snapshot: failed to take group snapshot of the volumes [%s %s]: \"rpc error: code = InvalidArgument desc = volumes on two pools\"", v1ID, v2ID)
	if st := got.Status; st == nil || st.Error == nil || st.Error.Message == nil || *st.Error.Message != want ||
		st.ReadyToUse == nil || *st.ReadyToUse {
		t.Errorf("status %+v, want not ready with error %q", st, want)
	}
	if ev := f.events(); !slices.Equal(ev, []string{"Warning GroupSnapshotCreationFailed " + want}) {
		t.Errorf("events %q", ev)
	}
	if w := f.writes(); len(w) == 0 || !strings.Contains(w[0].body, annGroupBeingCreated) || w[0].creates != 0 {
		t.Errorf("writes %+v, want the being-created record before the call", w)
	}
}

func TestGroupCreateNonFinalErrorKeepsRecord(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{})
	v1ID, v2ID := f.volume("pv-1"), f.volume("pv-2")
	f.add(dynamicGroupContent("gc-1", v1ID, v2ID), groupClass(groupTestClass, groupTestDriver, nil), groupSecret(groupTestSecret, "token"))
	// The driver cuts the group snapshot but the answer is lost: a timeout.
	if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateVolumeGroupSnapshot, Code: codes.DeadlineExceeded, Times: 1, ApplyAnyway: true}); err != nil {
		t.Fatal(err)
	}
	f.start()

	if err := f.sync("gc-1"); err == nil {
		t.Fatal("sync succeeded against a timed-out call")
	}
	got := f.stored("gc-1")
	if !hasAnnotation(got, annGroupBeingCreated) {
		t.Fatal("being-created annotation removed after a call that may still run")
	}
	if st := got.Status; st == nil || st.Error == nil || st.VolumeGroupSnapshotHandle != nil {
		t.Errorf("status %+v, want the error and no handle", st)
	}
	if ev := f.events(); len(ev) != 1 || !strings.HasPrefix(ev[0], "Warning GroupSnapshotCreationFailed ") {
		t.Errorf("events %q", ev)
	}
	// While it is there, a deletion agreed by the snapshot-controller waits.
	deleted := got.DeepCopy()
	deleted.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	deleted.Annotations[annGroupBeingDeleted] = "yes"
	if groupDeletionDue(deleted) {
		t.Error("deletion due while CreateVolumeGroupSnapshot may still run")
	}

	// The next try finds the group snapshot the lost call cut and records it.
	f.waitCached("gc-1", func(c *groupv1.VolumeGroupSnapshotContent) bool { return c.Status != nil })
	if err := f.sync("gc-1"); err != nil {
		t.Fatalf("retry: %v", err)
	}
	groups := f.driver.GroupSnapshots()
	if len(groups) != 1 {
		t.Fatalf("backend group snapshots %+v, want the one cut", groups)
	}
	got = f.stored("gc-1")
	if st := got.Status; st.VolumeGroupSnapshotHandle == nil || *st.VolumeGroupSnapshotHandle != groups[0].ID ||
		st.ReadyToUse == nil || !*st.ReadyToUse || st.Error != nil || len(st.VolumeSnapshotInfoList) != 2 {
		t.Errorf("status %+v, want the group snapshot recorded, ready, error cleared", st)
	}
	if hasAnnotation(got, annGroupBeingCreated) {
		t.Error("being-created annotation left on once recorded")
	}
}

// createdGroupContent is a group content whose group snapshot was taken and recorded.
func createdGroupContent(f *groupFixture, name string) (*groupv1.VolumeGroupSnapshotContent, testdriver.GroupSnapshot) {
	f.t.Helper()
	v1ID, v2ID := f.volume(name+"-pv-1"), f.volume(name+"-pv-2")
	g, err := f.driver.TakeGroupSnapshot("groupsnapshot-"+name, []string{v1ID, v2ID})
	if err != nil {
		f.t.Fatal(err)
	}
	c := dynamicGroupContent(name, v1ID, v2ID)
	now := metav1.Now()
	c.Status = &groupv1.VolumeGroupSnapshotContentStatus{
		VolumeGroupSnapshotHandle: &g.ID, ReadyToUse: new(true), CreationTime: &now,
	}
	for i, id := range g.SnapshotIDs {
		c.Status.VolumeSnapshotInfoList = append(c.Status.VolumeSnapshotInfoList,
			groupv1.VolumeSnapshotInfo{VolumeHandle: g.SourceVolumeIDs[i], SnapshotHandle: id, ReadyToUse: new(true)})
	}
	return c, g
}

func TestGroupDeleteWaitsForSnapshotController(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{})
	content, g := createdGroupContent(f, "gc-1")
	content.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	content.Finalizers = []string{groupFinalizer, "example.com/keep"}
	f.add(content, groupClass(groupTestClass, groupTestDriver, nil), groupSecret(groupTestSecret, "token"))
	f.start()

	// Not agreed yet: nothing happens.
	if err := f.sync("gc-1"); err != nil {
		t.Fatal(err)
	}
	if calls := f.driver.Calls(testdriver.MethodDeleteVolumeGroupSnapshot); len(calls) != 0 {
		t.Fatalf("DeleteVolumeGroupSnapshot before the snapshot-controller agreed: %+v", calls)
	}
	if got := f.stored("gc-1"); !slices.Contains(got.Finalizers, groupFinalizer) {
		t.Fatal("finalizer removed before the snapshot-controller agreed")
	}

	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"yes"}}}`, annGroupBeingDeleted)
	if _, err := f.snap.GroupsnapshotV1().VolumeGroupSnapshotContents().Patch(context.Background(), "gc-1", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	f.waitCached("gc-1", func(c *groupv1.VolumeGroupSnapshotContent) bool { return hasAnnotation(c, annGroupBeingDeleted) })
	if err := f.sync("gc-1"); err != nil {
		t.Fatalf("sync of an agreed deletion: %v", err)
	}
	calls := f.driver.Calls(testdriver.MethodDeleteVolumeGroupSnapshot)
	if len(calls) != 1 {
		t.Fatalf("DeleteVolumeGroupSnapshot calls %+v", calls)
	}
	if c := calls[0]; c.GroupSnapshotID != g.ID || !slices.Equal(c.SnapshotIDList(), g.SnapshotIDs) || c.SecretKeys != "token" {
		t.Errorf("call %+v, want group %s with members %v and the group snapshotter secret", c, g.ID, g.SnapshotIDs)
	}
	if n := len(f.driver.GroupSnapshots()); n != 0 {
		t.Errorf("%d group snapshots left in the backend", n)
	}
	got := f.stored("gc-1")
	if !slices.Equal(got.Finalizers, []string{"example.com/keep"}) {
		t.Errorf("finalizers %v, want only the other one kept", got.Finalizers)
	}
	// It outlives the finalizer: the deleted group snapshot is no longer on its status.
	if st := got.Status; st == nil || st.VolumeGroupSnapshotHandle != nil || st.ReadyToUse != nil || st.CreationTime != nil {
		t.Errorf("status %+v, want the handle, readiness and creation time cleared", st)
	}
	if ev := f.events(); len(ev) != 0 {
		t.Errorf("events %v", ev)
	}

	// Done: a later sync calls nothing.
	f.waitCached("gc-1", func(c *groupv1.VolumeGroupSnapshotContent) bool { return c.Status.VolumeGroupSnapshotHandle == nil })
	if err := f.sync("gc-1"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.driver.Calls(testdriver.MethodDeleteVolumeGroupSnapshot)); n != 1 {
		t.Errorf("%d DeleteVolumeGroupSnapshot calls, want 1", n)
	}
}

func TestGroupRetainKeepsGroupSnapshot(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{})
	content, _ := createdGroupContent(f, "gc-1")
	content.Spec.DeletionPolicy = snapv1.VolumeSnapshotContentRetain
	content.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	content.Annotations[annGroupBeingDeleted] = "yes"
	f.add(content, groupClass(groupTestClass, groupTestDriver, nil))
	f.start()

	if err := f.sync("gc-1"); err != nil {
		t.Fatal(err)
	}
	if calls := f.driver.Calls(testdriver.MethodDeleteVolumeGroupSnapshot); len(calls) != 0 {
		t.Errorf("DeleteVolumeGroupSnapshot of a retained group snapshot: %+v", calls)
	}
	if n := len(f.driver.GroupSnapshots()); n != 1 {
		t.Errorf("%d group snapshots in the backend, want the retained one", n)
	}
	if got := f.stored("gc-1"); len(got.Finalizers) != 0 {
		t.Errorf("finalizers %v, want none", got.Finalizers)
	}
}

func TestGroupDeleteFailureIsAnEvent(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{})
	content, _ := createdGroupContent(f, "gc-1")
	content.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	content.Annotations[annGroupBeingDeleted] = "yes"
	f.add(content, groupClass(groupTestClass, groupTestDriver, nil), groupSecret(groupTestSecret, "token"))
	if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodDeleteVolumeGroupSnapshot, Code: codes.Internal}); err != nil {
		t.Fatal(err)
	}
	f.start()

	if err := f.sync("gc-1"); err == nil {
		t.Fatal("sync succeeded against a failing DeleteVolumeGroupSnapshot")
	}
	if got := f.stored("gc-1"); !slices.Contains(got.Finalizers, groupFinalizer) {
		t.Error("finalizer removed though the group snapshot was not deleted")
	}
	if ev := f.events(); !slices.Equal(ev, []string{"Warning GroupSnapshotDeleteError Failed to delete group snapshot"}) {
		t.Errorf("events %q", ev)
	}
}

func TestGroupPreProvisionedCheck(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{SnapshotReadyAfterPolls: 1})
	v1ID, v2ID := f.volume("pv-1"), f.volume("pv-2")
	g, err := f.driver.TakeGroupSnapshot("existing", []string{v1ID, v2ID})
	if err != nil {
		t.Fatal(err)
	}
	class := groupTestClass
	content := &groupv1.VolumeGroupSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{Name: "gc-pre", UID: "uid-gc-pre", Finalizers: []string{groupFinalizer}},
		Spec: groupv1.VolumeGroupSnapshotContentSpec{
			VolumeGroupSnapshotRef:       v1.ObjectReference{Namespace: "ns", Name: "vgs", UID: "vgs-uid"},
			DeletionPolicy:               snapv1.VolumeSnapshotContentRetain,
			Driver:                       groupTestDriver,
			VolumeGroupSnapshotClassName: &class,
			Source: groupv1.VolumeGroupSnapshotContentSource{GroupSnapshotHandles: &groupv1.GroupSnapshotHandles{
				VolumeGroupSnapshotHandle: g.ID, VolumeSnapshotHandles: g.SnapshotIDs,
			}},
		},
	}
	f.add(content,
		groupClass(groupTestClass, groupTestDriver, map[string]string{
			paramGroupGetSecretName:      "get-${volumegroupsnapshotcontent.name}",
			paramGroupGetSecretNamespace: "default",
		}),
		groupSecret("get-gc-pre", "reader"))
	f.start()

	if err := f.sync("gc-pre"); !errors.Is(err, errPending) {
		t.Fatalf("sync of a pre-provisioned group snapshot not ready: %v, want errPending", err)
	}
	gets := f.driver.Calls(testdriver.MethodGetVolumeGroupSnapshot)
	if len(gets) != 1 {
		t.Fatalf("GetVolumeGroupSnapshot calls %+v", gets)
	}
	if c := gets[0]; c.GroupSnapshotID != g.ID || !slices.Equal(c.SnapshotIDList(), g.SnapshotIDs) || c.SecretKeys != "reader" {
		t.Errorf("call %+v, want group %s with members %v and the group-snapshotter-get secret", c, g.ID, g.SnapshotIDs)
	}
	st := f.stored("gc-pre").Status
	if st == nil || st.VolumeGroupSnapshotHandle == nil || *st.VolumeGroupSnapshotHandle != g.ID ||
		st.ReadyToUse == nil || *st.ReadyToUse || st.CreationTime == nil || len(st.VolumeSnapshotInfoList) != 0 {
		t.Fatalf("status %+v, want the handle, not ready, and no members (as upstream)", st)
	}

	f.waitCached("gc-pre", func(c *groupv1.VolumeGroupSnapshotContent) bool { return c.Status != nil })
	if err := f.sync("gc-pre"); err != nil {
		t.Fatalf("second sync: %v", err)
	}
	if st := f.stored("gc-pre").Status; st.ReadyToUse == nil || !*st.ReadyToUse {
		t.Errorf("readyToUse %v once ready", st.ReadyToUse)
	}
	if n := len(f.driver.Calls(testdriver.MethodCreateVolumeGroupSnapshot)); n != 0 {
		t.Errorf("%d CreateVolumeGroupSnapshot calls for a pre-provisioned group snapshot", n)
	}
}

func TestGroupWorkersTakeNewContents(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{})
	v1ID := f.volume("pv-1")
	f.add(groupClass(groupTestClass, groupTestDriver, nil), groupSecret(groupTestSecret, "token"))
	f.start()
	intake, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f.g.run(intake, context.Background(), 2)
	}()
	defer func() { stop(); <-done }()

	if _, err := f.snap.GroupsnapshotV1().VolumeGroupSnapshotContents().Create(context.Background(), dynamicGroupContent("gc-1", v1ID), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	f.waitCached("gc-1", groupReady)
	if n := len(f.driver.GroupSnapshots()); n != 1 {
		t.Errorf("%d group snapshots, want 1", n)
	}
}

func TestGroupContentChanged(t *testing.T) {
	base := dynamicGroupContent("gc-1", "v1")
	base.ResourceVersion = "1"
	next := func(change func(*groupv1.VolumeGroupSnapshotContent)) *groupv1.VolumeGroupSnapshotContent {
		c := base.DeepCopy()
		c.ResourceVersion = "2"
		change(c)
		return c
	}
	for _, tc := range []struct {
		name string
		obj  *groupv1.VolumeGroupSnapshotContent
		want bool
	}{
		{"resync", base.DeepCopy(), true},
		{"status", next(func(c *groupv1.VolumeGroupSnapshotContent) {
			c.Status = &groupv1.VolumeGroupSnapshotContentStatus{ReadyToUse: new(false)}
		}), false},
		{"turned ready", next(func(c *groupv1.VolumeGroupSnapshotContent) {
			c.Status = &groupv1.VolumeGroupSnapshotContentStatus{ReadyToUse: new(true)}
		}), true},
		{"finalizers", next(func(c *groupv1.VolumeGroupSnapshotContent) { c.Finalizers = nil }), false},
		{"being-created", next(func(c *groupv1.VolumeGroupSnapshotContent) { c.Annotations[annGroupBeingCreated] = "yes" }), false},
		{"being-deleted", next(func(c *groupv1.VolumeGroupSnapshotContent) { c.Annotations[annGroupBeingDeleted] = "yes" }), true},
		{"deletion", next(func(c *groupv1.VolumeGroupSnapshotContent) { c.DeletionTimestamp = &metav1.Time{Time: time.Now()} }), true},
	} {
		if got := changed(base, tc.obj, groupRules()); got != tc.want {
			t.Errorf("%s: changed %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestGroupOurs(t *testing.T) {
	f := newGroupFixture(t, testdriver.Config{})
	f.add(groupClass(groupTestClass, groupTestDriver, nil), groupClass("other-class", "other.csi", nil))
	f.start()
	for _, tc := range []struct {
		name   string
		change func(*groupv1.VolumeGroupSnapshotContent)
		want   bool
	}{
		{"ours", func(*groupv1.VolumeGroupSnapshotContent) {}, true},
		{"other driver", func(c *groupv1.VolumeGroupSnapshotContent) { c.Spec.Driver = "other.csi" }, false},
		{"other class driver", func(c *groupv1.VolumeGroupSnapshotContent) { c.Spec.VolumeGroupSnapshotClassName = new("other-class") }, false},
		{"unknown class", func(c *groupv1.VolumeGroupSnapshotContent) { c.Spec.VolumeGroupSnapshotClassName = new("missing") }, true},
		{"no source", func(c *groupv1.VolumeGroupSnapshotContent) {
			c.Spec.Source = groupv1.VolumeGroupSnapshotContentSource{}
		}, false},
		{"pre-provisioned", func(c *groupv1.VolumeGroupSnapshotContent) {
			c.Spec.Source = groupv1.VolumeGroupSnapshotContentSource{GroupSnapshotHandles: &groupv1.GroupSnapshotHandles{VolumeGroupSnapshotHandle: "g"}}
		}, true},
	} {
		c := dynamicGroupContent("gc-1", "v1")
		tc.change(c)
		if got := f.g.ours(c); got != tc.want {
			t.Errorf("%s: ours %v, want %v", tc.name, got, tc.want)
		}
	}
}
