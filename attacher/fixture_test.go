package attacher

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	csitrans "k8s.io/csi-translation-lib"

	"github.com/csi-sidecars/csi-sidecars/attacher/nodeid"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cachetest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

const (
	testDriver = testdriver.DefaultDriverName
	testNode   = "node-1"
	testNodeID = "node-1-id"
)

// fixture is one controller over a fake clientset and the test CSI driver on a UNIX socket.
type fixture struct {
	t       *testing.T
	kube    *fake.Clientset
	ctrl    *Controller
	backend *testdriver.Backend
	csi     *recordingClient
	// gated, when set, holds CSI calls until the test lets them in (workers_test.go).
	gated *gatedClient
	// vaStore is the VolumeAttachment informer's store, for tests that make it lag.
	vaStore cache.Store
}

// defaultConfig is the configuration of a driver with every capability the attacher uses.
func defaultConfig() config {
	return config{
		driver:             testDriver,
		timeout:            5 * time.Second,
		workers:            2,
		retryIntervalStart: 10 * time.Millisecond,
		retryIntervalMax:   100 * time.Millisecond,
		reconcileSync:      time.Minute,
		publishReadOnly:    true,
		reconcile:          true,
		errorCodes:         true,
	}
}

// newFixture serves backend on a new socket and starts a controller over objects.
func newFixture(t *testing.T, cfg config, backend *testdriver.Backend, objects ...runtime.Object) *fixture {
	t.Helper()
	conn := serve(t, backend)
	kube := fake.NewClientset(objects...)
	// Decisions are fed from objects trimmed as the core's caches trim them.
	factory := informers.NewSharedInformerFactoryWithOptions(kube, 0, informers.WithTransform(cachetest.Transform()))
	ops, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() {
		cancel()
		factory.Shutdown()
	})
	ctrl, err := newController(cfg, kube, factory, conn, csitrans.New(), ops)
	if err != nil {
		t.Fatal(err)
	}
	rec := &recordingClient{ControllerClient: ctrl.calls.Client}
	ctrl.calls.Client = rec
	factory.Start(ops.Done())
	for typ, ok := range factory.WaitForCacheSync(ops.Done()) {
		if !ok {
			t.Fatalf("cache of %v not synced", typ)
		}
	}
	vaStore := factory.Storage().V1().VolumeAttachments().Informer().GetStore()
	return &fixture{t: t, kube: kube, ctrl: ctrl, backend: backend, csi: rec, vaStore: vaStore}
}

// serve serves backend in memory and returns a connection to it: no real I/O, so that a
// test may run in a synctest bubble.
func serve(t *testing.T, backend *testdriver.Backend) *grpc.ClientConn {
	return testdriver.DialInMemory(t, backend)
}

// newBackendWithVolume is a test driver with one volume; it returns the volume's ID.
func newBackendWithVolume(t *testing.T, cfg ...testdriver.Config) (*testdriver.Backend, string) {
	t.Helper()
	cfg = append(cfg, testdriver.Config{})
	backend, err := testdriver.New(cfg[0])
	if err != nil {
		t.Fatal(err)
	}
	return backend, createVolume(t, csi.NewControllerClient(serve(t, backend)), "vol")
}

// createVolume makes a volume in the driver and returns its ID.
func createVolume(t *testing.T, client csi.ControllerClient, name string) string {
	t.Helper()
	rsp, err := client.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name:               name,
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
	})
	if err != nil {
		t.Fatalf("creating volume %s: %v", name, err)
	}
	return rsp.GetVolume().GetVolumeId()
}

// sync runs one sync of a VolumeAttachment, clearing the recorded API actions first so a
// test sees only what this sync did.
func (f *fixture) sync(name string) error {
	f.kube.ClearActions()
	return f.ctrl.syncVA(name)
}

func (f *fixture) va(name string) *storagev1.VolumeAttachment {
	f.t.Helper()
	va, err := f.kube.StorageV1().VolumeAttachments().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return va
}

func (f *fixture) pv(name string) *corev1.PersistentVolume {
	f.t.Helper()
	pv, err := f.kube.CoreV1().PersistentVolumes().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return pv
}

// waitForCache waits until the controller's VolumeAttachment cache satisfies cond.
func (f *fixture) waitForCache(name string, cond func(*storagev1.VolumeAttachment) bool) {
	f.t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		va, err := f.ctrl.vaLister.Get(name)
		return err == nil && cond(va), nil
	})
	if err != nil {
		f.t.Fatalf("cache of VolumeAttachment %s: %v", name, err)
	}
}

// writes are the API writes (patch, update) of the last sync, as "verb resource/subresource".
func (f *fixture) writes() []string {
	var out []string
	for _, a := range f.kube.Actions() {
		if a.GetVerb() != "patch" && a.GetVerb() != "update" {
			continue
		}
		w := a.GetVerb() + " " + a.GetResource().Resource
		if a.GetSubresource() != "" {
			w += "/" + a.GetSubresource()
		}
		out = append(out, w)
	}
	return out
}

// waitFor waits until cond holds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		return cond(), nil
	})
	if err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

// failStatusOnce is a reactor failing the first status patch.
func failStatusOnce() k8stesting.ReactionFunc {
	var once sync.Once
	return func(a k8stesting.Action) (bool, runtime.Object, error) {
		failed := false
		if a.GetSubresource() == "status" {
			once.Do(func() { failed = true })
		}
		if failed {
			return true, nil, apierrors.NewInternalError(errors.New("injected"))
		}
		return false, nil, nil
	}
}

// failWrites makes the next n writes of resource fail with err.
func (f *fixture) failWrites(resource string, n int, err error) {
	var mu sync.Mutex
	f.kube.PrependReactor("patch", resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		if n == 0 {
			return false, nil, nil
		}
		n--
		return true, nil, err
	})
}

// recordingClient remembers every publish and unpublish request before the driver gets it.
type recordingClient struct {
	csi.ControllerClient
	mu          sync.Mutex
	publishes   []*csi.ControllerPublishVolumeRequest
	unpublishes []*csi.ControllerUnpublishVolumeRequest
}

func (r *recordingClient) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest, opts ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error) {
	r.mu.Lock()
	r.publishes = append(r.publishes, proto.Clone(req).(*csi.ControllerPublishVolumeRequest))
	r.mu.Unlock()
	return r.ControllerClient.ControllerPublishVolume(ctx, req, opts...)
}

func (r *recordingClient) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest, opts ...grpc.CallOption) (*csi.ControllerUnpublishVolumeResponse, error) {
	r.mu.Lock()
	r.unpublishes = append(r.unpublishes, proto.Clone(req).(*csi.ControllerUnpublishVolumeRequest))
	r.mu.Unlock()
	return r.ControllerClient.ControllerUnpublishVolume(ctx, req, opts...)
}

func (r *recordingClient) lastPublish() *csi.ControllerPublishVolumeRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.publishes) == 0 {
		return nil
	}
	return r.publishes[len(r.publishes)-1]
}

func (r *recordingClient) counts() (publishes, unpublishes int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.publishes), len(r.unpublishes)
}

// Objects.

func newPV(name, handle string, mutate ...func(*corev1.PersistentVolume)) *corev1.PersistentVolume {
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver:       testDriver,
				VolumeHandle: handle,
				FSType:       "ext4",
			}},
		},
	}
	for _, m := range mutate {
		m(pv)
	}
	return pv
}

func newVA(name, pvName string, mutate ...func(*storagev1.VolumeAttachment)) *storagev1.VolumeAttachment {
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: storagev1.VolumeAttachmentSpec{
			Attacher: testDriver,
			NodeName: testNode,
			Source:   storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName},
		},
	}
	for _, m := range mutate {
		m(va)
	}
	return va
}

func newCSINode(node, nodeID string) *storagev1.CSINode {
	return &storagev1.CSINode{
		ObjectMeta: metav1.ObjectMeta{Name: node},
		Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{
			{Name: "other.csi.example.com", NodeID: "wrong"},
			{Name: testDriver, NodeID: nodeID},
		}},
	}
}

func deleting(va *storagev1.VolumeAttachment) {
	now := metav1.Now()
	va.DeletionTimestamp = &now
}

func attachedWith(finalizers ...string) func(*storagev1.VolumeAttachment) {
	return func(va *storagev1.VolumeAttachment) {
		va.Finalizers = finalizers
		va.Annotations = map[string]string{nodeid.Annotation: testNodeID}
		va.Status.Attached = true
		va.Status.AttachmentMetadata = map[string]string{"devicePath": "/dev/x"}
	}
}

// withDetachError leaves the error of an earlier failed detach in the status.
func withDetachError(va *storagev1.VolumeAttachment) {
	va.Status.DetachError = &storagev1.VolumeError{Message: "earlier attempt failed", Time: metav1.Now()}
}
