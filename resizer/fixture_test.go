package resizer

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cachetest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

const testDriver = "unit.csi.test"

// fixture is one controller over a fake API server and the test CSI driver on a UNIX socket.
type fixture struct {
	t        *testing.T
	kube     *fake.Clientset
	versions *versionedTracker
	factory  informers.SharedInformerFactory
	driver   *testdriver.Backend
	conn     *grpc.ClientConn
	recorder *record.FakeRecorder
	w        writer
}

func newFixture(t *testing.T, cfg testdriver.Config, objs ...runtime.Object) *fixture {
	t.Helper()
	cfg.DriverName = testDriver
	return newFixtureOf(t, cfg, objs...)
}

// newFixtureOf is newFixture for the driver cfg names.
func newFixtureOf(t *testing.T, cfg testdriver.Config, objs ...runtime.Object) *fixture {
	t.Helper()
	d, err := testdriver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	conn := testdriver.Dial(t, d)
	kube := fake.NewClientset()
	versions := &versionedTracker{ObjectTracker: kube.Tracker()}
	kube.PrependReactor("*", "*", k8stesting.ObjectReaction(versions))
	f := &fixture{
		t: t, kube: kube, versions: versions, driver: d, conn: conn,
		// Decisions are fed from objects trimmed as the core's caches trim them.
		factory:  informers.NewSharedInformerFactoryWithOptions(kube, 0, informers.WithTransform(cachetest.Transform())),
		recorder: record.NewFakeRecorder(100),
	}
	w, err := newWriter(kube, context.Background, f.recorder, cfg.DriverName, f.factory)
	if err != nil {
		t.Fatal(err)
	}
	f.w = w.withCallTimeout(5 * time.Second)
	f.add(objs...)
	return f
}

// add puts objects in the fake API server, with resourceVersions.
func (f *fixture) add(objs ...runtime.Object) {
	f.t.Helper()
	for _, o := range objs {
		if err := f.versions.Add(o); err != nil {
			f.t.Fatal(err)
		}
	}
}

// versionedTracker gives the fake API server what the resizer relies on and the fake
// tracker leaves out: every write sets a new, increasing resourceVersion on the object, and
// an update or patch that carries a resourceVersion other than the stored one fails with a
// conflict.
type versionedTracker struct {
	k8stesting.ObjectTracker
	mu      sync.Mutex
	version int
}

func (t *versionedTracker) stamp(obj runtime.Object) error {
	m, err := meta.Accessor(obj)
	if err != nil {
		return err
	}
	t.version++
	m.SetResourceVersion(strconv.Itoa(t.version))
	return nil
}

func (t *versionedTracker) Add(obj runtime.Object) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	obj = obj.DeepCopyObject()
	if err := t.stamp(obj); err != nil {
		return err
	}
	return t.ObjectTracker.Add(obj)
}

func (t *versionedTracker) Create(gvr schema.GroupVersionResource, obj runtime.Object, ns string, opts ...metav1.CreateOptions) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.stamp(obj); err != nil {
		return err
	}
	return t.ObjectTracker.Create(gvr, obj, ns, opts...)
}

func (t *versionedTracker) Update(gvr schema.GroupVersionResource, obj runtime.Object, ns string, opts ...metav1.UpdateOptions) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.checkVersion(gvr, obj, ns); err != nil {
		return err
	}
	return t.ObjectTracker.Update(gvr, obj, ns, opts...)
}

func (t *versionedTracker) Patch(gvr schema.GroupVersionResource, obj runtime.Object, ns string, opts ...metav1.PatchOptions) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.checkVersion(gvr, obj, ns); err != nil {
		return err
	}
	return t.ObjectTracker.Patch(gvr, obj, ns, opts...)
}

// checkVersion fails a write whose object carries a stale resourceVersion, and stamps it.
func (t *versionedTracker) checkVersion(gvr schema.GroupVersionResource, obj runtime.Object, ns string) error {
	m, err := meta.Accessor(obj)
	if err != nil {
		return err
	}
	stored, err := t.ObjectTracker.Get(gvr, ns, m.GetName(), metav1.GetOptions{})
	if err != nil {
		return err
	}
	sm, err := meta.Accessor(stored)
	if err != nil {
		return err
	}
	if rv := m.GetResourceVersion(); rv != "" && rv != sm.GetResourceVersion() {
		return apierrors.NewConflict(gvr.GroupResource(), m.GetName(), fmt.Errorf("resourceVersion %s is not the stored %s", rv, sm.GetResourceVersion()))
	}
	return t.stamp(obj)
}

// start starts the informers and waits for their caches.
func (f *fixture) start() {
	stop := make(chan struct{})
	f.t.Cleanup(func() { close(stop) })
	f.factory.Start(stop)
	for typ, ok := range f.factory.WaitForCacheSync(stop) {
		if !ok {
			f.t.Fatalf("cache of %v not synced", typ)
		}
	}
}

func (f *fixture) controllerClient() csi.ControllerClient { return csi.NewControllerClient(f.conn) }

// createVolume creates a backend volume of size bytes and returns its id.
func (f *fixture) createVolume(name string, size int64) string {
	f.t.Helper()
	rsp, err := f.controllerClient().CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
	})
	if err != nil {
		f.t.Fatal(err)
	}
	return rsp.GetVolume().GetVolumeId()
}

// boundPair is a bound PV/PVC pair of the test driver, as the PV controller leaves them.
func boundPair(name, handle, request, capacity string) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
	pvc := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID("uid-ns-" + name)},
		Spec: v1.PersistentVolumeClaimSpec{
			AccessModes: []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			VolumeName:  "pv-" + name,
			Resources:   v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse(request)}},
		},
		Status: v1.PersistentVolumeClaimStatus{Phase: v1.ClaimBound, Capacity: v1.ResourceList{v1.ResourceStorage: resource.MustParse(capacity)}},
	}
	pv := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pv-" + name},
		Spec: v1.PersistentVolumeSpec{
			AccessModes:            []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			Capacity:               v1.ResourceList{v1.ResourceStorage: resource.MustParse(capacity)},
			ClaimRef:               &v1.ObjectReference{Namespace: "ns", Name: name, UID: pvc.UID},
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: testDriver, VolumeHandle: handle}},
		},
		Status: v1.PersistentVolumeStatus{Phase: v1.VolumeBound},
	}
	return pvc, pv
}

func (f *fixture) pvc(name string) *v1.PersistentVolumeClaim {
	f.t.Helper()
	pvc, err := f.kube.CoreV1().PersistentVolumeClaims("ns").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return pvc
}

func (f *fixture) pv(name string) *v1.PersistentVolume {
	f.t.Helper()
	pv, err := f.kube.CoreV1().PersistentVolumes().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return pv
}

// settle waits until the informer caches show what the fake API server holds, as they
// would before the next sync of a real controller.
func (f *fixture) settle() {
	f.t.Helper()
	pvcs := f.factory.Core().V1().PersistentVolumeClaims().Lister()
	pvs := f.factory.Core().V1().PersistentVolumes().Lister()
	err := wait.PollUntilContextTimeout(context.Background(), 5*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		apiPVCs, _ := f.kube.CoreV1().PersistentVolumeClaims("").List(context.Background(), metav1.ListOptions{})
		for _, want := range apiPVCs.Items {
			got, err := pvcs.PersistentVolumeClaims(want.Namespace).Get(want.Name)
			trimmed, _ := lifecycle.TrimForCache(&want)
			if err != nil || !equality.Semantic.DeepEqual(got, trimmed) {
				return false, nil
			}
		}
		apiPVs, _ := f.kube.CoreV1().PersistentVolumes().List(context.Background(), metav1.ListOptions{})
		for _, want := range apiPVs.Items {
			got, err := pvs.Get(want.Name)
			trimmed, _ := lifecycle.TrimForCache(&want)
			if err != nil || !equality.Semantic.DeepEqual(got, trimmed) {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		f.t.Fatalf("caches did not settle: %v", err)
	}
}

// update writes a changed PVC (spec, as a user) and waits for the caches.
func (f *fixture) updateClaim(pvc *v1.PersistentVolumeClaim) {
	f.t.Helper()
	if _, err := f.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Update(context.Background(), pvc, metav1.UpdateOptions{}); err != nil {
		f.t.Fatal(err)
	}
	f.settle()
}

// writes counts the patches and updates the controller sent since the last call.
func (f *fixture) writes() int {
	n := 0
	for _, a := range f.kube.Actions() {
		switch a.(type) {
		case k8stesting.PatchAction, k8stesting.UpdateAction:
			n++
		}
	}
	f.kube.ClearActions()
	return n
}

// events drains the recorded events ("Type Reason Message").
func (f *fixture) events() []string {
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

// hasEvent tells whether one of events starts with prefix ("Normal Resizing").
func hasEvent(events []string, prefix string) bool {
	for _, e := range events {
		if strings.HasPrefix(e, prefix) {
			return true
		}
	}
	return false
}

// calls returns the driver's journal entries of method.
func (f *fixture) calls(method string) []testdriver.Call { return f.driver.Calls(method) }

func condition(pvc *v1.PersistentVolumeClaim, t v1.PersistentVolumeClaimConditionType) *v1.PersistentVolumeClaimCondition {
	for i := range pvc.Status.Conditions {
		if pvc.Status.Conditions[i].Type == t {
			return &pvc.Status.Conditions[i]
		}
	}
	return nil
}

func gi(n int64) int64 { return n << 30 }
