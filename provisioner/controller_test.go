package provisioner

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	eventrecord "k8s.io/client-go/tools/record"
	"k8s.io/component-base/metrics"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cachetest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/record"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// world is a controller on a fake clientset and the project's test driver, running.
type world struct {
	t        *testing.T
	kube     *fake.Clientset
	driver   *testdriver.Backend
	ctrl     *claimController
	recorder *eventrecord.FakeRecorder
	// seenEvents are the API's events events() returned already.
	seenEvents map[string]bool
	registry   metrics.KubeRegistry
	factory    informers.SharedInformerFactory
	// stopIntake is SIGTERM as the controller sees it; done closes when run returned.
	intake     context.Context
	stopIntake context.CancelFunc
	started    bool
	done       chan struct{}
}

func newWorld(t *testing.T, dcfg testdriver.Config, change func(*config), objects ...runtime.Object) *world {
	t.Helper()
	w := newHeldWorld(t, dcfg, change, objects...)
	w.start()
	return w
}

// newHeldWorld is newWorld with its informers running and its workers not yet (start):
// objects a test adds now are all in the caches, as a new leader finds them, before
// anything is decided.
func newHeldWorld(t *testing.T, dcfg testdriver.Config, change func(*config), objects ...runtime.Object) *world {
	t.Helper()
	// drv unless the test runs the driver under another name (CSI migration).
	if dcfg.DriverName == "" {
		dcfg.DriverName = drv
	}
	b, err := testdriver.New(dcfg)
	if err != nil {
		t.Fatal(err)
	}
	// In memory, so that a test may run the world in a synctest bubble.
	conn := testdriver.DialInMemory(t, b)
	plugin, err := rpc.GetPluginCapabilities(context.Background(), conn)
	if err != nil {
		t.Fatal(err)
	}
	controllerCaps, err := rpc.GetControllerCapabilities(context.Background(), conn)
	if err != nil {
		t.Fatal(err)
	}
	var o options
	if err := newFlagSet(&o).Parse([]string{"--worker-threads=4", "--retry-interval-start=20ms", "--retry-interval-max=200ms"}); err != nil {
		t.Fatal(err)
	}
	w := &world{t: t, kube: fake.NewClientset(objects...), driver: b, recorder: eventrecord.NewFakeRecorder(1000),
		seenEvents: map[string]bool{}, registry: metrics.NewKubeRegistry(), done: make(chan struct{})}
	stampResourceVersions(&w.kube.Fake)
	// The record events' informer trims them in place, as the core's caches do.
	cachetest.CopyingWatches(w.kube)
	m, err := newControllerMetrics(w.registry)
	if err != nil {
		t.Fatal(err)
	}
	cfg := config{
		opts: o, driver: dcfg.DriverName, inTree: request.NamesOf(dcfg.DriverName).InTree, identity: "test-id", kube: w.kube, csi: csi.NewControllerClient(conn),
		ops: context.Background(), recorder: w.recorder, metrics: m,
		pluginCaps: plugin, controllerCaps: controllerCaps,
		topology: plugin[csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS], vac: true,
	}
	if change != nil {
		change(&cfg)
	}
	// Decisions are fed from objects trimmed as the core's caches trim them.
	factory := informers.NewSharedInformerFactoryWithOptions(w.kube, 0, informers.WithTransform(cachetest.Transform()))
	w.factory = factory
	if w.ctrl, err = newController(cfg, factory); err != nil {
		t.Fatal(err)
	}
	stopInformers := make(chan struct{})
	factory.Start(stopInformers)
	w.ctrl.startInformers(stopInformers)
	factory.WaitForCacheSync(stopInformers)
	cache.WaitForCacheSync(stopInformers, w.ctrl.records.HasSynced)
	intake, stopIntake := context.WithCancel(context.Background())
	w.intake, w.stopIntake = intake, stopIntake
	t.Cleanup(func() {
		stopIntake()
		if w.started {
			<-w.done
		}
		close(stopInformers)
	})
	return w
}

// start runs the controller's workers (a held world's caches and queues fill without them).
func (w *world) start() {
	w.started = true
	go func() {
		defer close(w.done)
		w.ctrl.run(w.intake)
	}()
}

// lastResourceVersion is the resource version stampResourceVersions gave last, shared by
// every fake client of a test binary so that no two writes share one.
var lastResourceVersion atomic.Int64

// stampResourceVersions gives every object a client creates or updates a new resource
// version, as the API server does (the fake tracker does not): the controller tells its
// own writes' copies apart by them.
func stampResourceVersions(f *k8stesting.Fake) {
	f.PrependReactor("*", "*", func(a k8stesting.Action) (bool, runtime.Object, error) {
		var obj runtime.Object
		switch a := a.(type) {
		case k8stesting.CreateAction:
			obj = a.GetObject()
		case k8stesting.UpdateAction:
			obj = a.GetObject()
		default:
			return false, nil, nil
		}
		if m, err := meta.Accessor(obj); err == nil {
			m.SetResourceVersion(strconv.FormatInt(lastResourceVersion.Add(1), 10))
		}
		return false, nil, nil
	})
}

// settle waits until the caches show what the fake API server holds, trimmed as the core's
// caches trim it, as they would before the next sync of a real controller.
func (w *world) settle() {
	w.t.Helper()
	ctx := context.Background()
	claims := w.factory.Core().V1().PersistentVolumeClaims().Lister()
	pvs := w.factory.Core().V1().PersistentVolumes().Lister()
	w.waitFor("the caches to show the API server's objects", func() bool {
		apiClaims, err := w.kube.CoreV1().PersistentVolumeClaims("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		for i := range apiClaims.Items {
			want := &apiClaims.Items[i]
			got, err := claims.PersistentVolumeClaims(want.Namespace).Get(want.Name)
			trimmed, _ := lifecycle.TrimForCache(want.DeepCopy())
			if err != nil || !equality.Semantic.DeepEqual(got, trimmed) {
				return false
			}
		}
		apiPVs, err := w.kube.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		for i := range apiPVs.Items {
			want := &apiPVs.Items[i]
			got, err := pvs.Get(want.Name)
			trimmed, _ := lifecycle.TrimForCache(want.DeepCopy())
			if err != nil || !equality.Semantic.DeepEqual(got, trimmed) {
				return false
			}
		}
		return true
	})
}

func (w *world) waitFor(what string, cond func() bool) {
	w.t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return cond(), nil
	}); err != nil {
		w.t.Fatalf("waiting for %s: %v", what, err)
	}
}

func (w *world) pv(name string) *v1.PersistentVolume {
	pv, err := w.kube.CoreV1().PersistentVolumes().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		return nil
	}
	return pv
}

// events drains the events so far: the recorder's, and those written through the API
// (the record's), each once, as "type reason message".
func (w *world) events() []string {
	var out []string
	if list, err := w.kube.CoreV1().Events("").List(context.Background(), metav1.ListOptions{}); err == nil {
		slices.SortFunc(list.Items, func(a, b v1.Event) int { return a.FirstTimestamp.Compare(b.FirstTimestamp.Time) })
		for _, ev := range list.Items {
			if !w.seenEvents[ev.Namespace+"/"+ev.Name] {
				w.seenEvents[ev.Namespace+"/"+ev.Name] = true
				out = append(out, ev.Type+" "+ev.Reason+" "+ev.Message)
			}
		}
	}
	for {
		select {
		case e := <-w.recorder.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

// record is the claim's open record as the API server's events say; nil for none.
func (w *world) record(uid string) *record.OpenRecord {
	w.t.Helper()
	list, err := w.kube.CoreV1().Events("").List(context.Background(), metav1.ListOptions{LabelSelector: record.Label})
	if err != nil {
		w.t.Fatal(err)
	}
	var events []*v1.Event
	for i := range list.Items {
		// The events about the claim, and those carrying its record among others'.
		if slices.Contains(record.ClaimKeys(&list.Items[i]), uid) {
			events = append(events, &list.Items[i])
		}
	}
	r, err := record.OpenAmong(events, uid)
	if err != nil {
		w.t.Fatal(err)
	}
	return r
}

// deadLeaderRecord is the event a provisioner that died since wrote to open the claim's
// record.
func deadLeaderRecord(t *testing.T, claim *v1.PersistentVolumeClaim, rec *record.Record) *v1.Event {
	t.Helper()
	ev, err := record.OpeningEvent(drv, v1.EventSource{Component: drv + "_dead"}, claim, rec)
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func (w *world) calls(method string) []testdriver.Call { return w.driver.Calls(method) }

func TestProvisionsAClaimAndRecordsTheVolumeAsAPersistentVolume(t *testing.T) {
	sc := class("fast", func(sc *storagev1.StorageClass) {
		sc.Parameters[request.ProvisionerSecret.NameKey] = "${pvc.name}-creds"
		sc.Parameters[request.ProvisionerSecret.NamespaceKey] = "${pvc.namespace}"
		sc.Parameters[request.FSTypeKey] = "xfs"
	})
	secret := &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "data-creds", Namespace: "ns"}, Data: map[string][]byte{"token": []byte("t")}}
	w := newWorld(t, testdriver.Config{}, nil, sc, secret, claimFor("data", "uid-1", "fast"))

	w.waitFor("the PersistentVolume", func() bool { return w.pv("pvc-uid-1") != nil })
	pv := w.pv("pvc-uid-1")
	calls := w.calls(testdriver.MethodCreateVolume)
	if len(calls) != 1 || calls[0].VolumeName != "pvc-uid-1" {
		t.Fatalf("CreateVolume calls %+v, want one for pvc-uid-1", calls)
	}
	vol, _ := w.driver.Volume(calls[0].VolumeID)
	if vol.Parameters["type"] != "fast" || len(vol.Parameters) != 1 {
		t.Errorf("driver got parameters %v, want only type=fast", vol.Parameters)
	}
	if pv.Spec.CSI.VolumeHandle != calls[0].VolumeID || pv.Spec.ClaimRef.UID != "uid-1" || pv.Spec.CSI.FSType != "xfs" ||
		pv.Annotations[request.AnnDeletionSecretName] != "data-creds" || pv.Annotations[volumehelpers.AnnDynamicallyProvisioned] != drv ||
		!slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer) {
		t.Errorf("PV does not record the volume for the claim: %+v", pv)
	}
	// The event follows the PV's creation; the record on the claim replaced upstream's
	// "Provisioning" event, so ProvisioningSucceeded is the only one.
	var events []string
	w.waitFor("a ProvisioningSucceeded event", func() bool {
		events = append(events, w.events()...)
		return slices.ContainsFunc(events, func(e string) bool { return strings.Contains(e, "ProvisioningSucceeded") })
	})
}

func TestAClaimWhoseSecretIsMissingIsNotProvisionedUntilTheSecretExists(t *testing.T) {
	sc := class("fast", func(sc *storagev1.StorageClass) {
		sc.Parameters[request.ProvisionerSecret.NameKey] = "creds"
		sc.Parameters[request.ProvisionerSecret.NamespaceKey] = "ns"
	})
	w := newWorld(t, testdriver.Config{}, nil, sc, claimFor("data", "uid-1", "fast"))
	w.waitFor("a ProvisioningFailed event", func() bool {
		return slices.ContainsFunc(w.events(), func(e string) bool { return strings.Contains(e, "ProvisioningFailed") && strings.Contains(e, "creds") })
	})
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 0 {
		t.Fatalf("%d CreateVolume calls without the secret", n)
	}
	if _, err := w.kube.CoreV1().Secrets("ns").Create(context.Background(), &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds", Namespace: "ns"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the PersistentVolume", func() bool { return w.pv("pvc-uid-1") != nil })
}

// A CreateVolume that timed out may still make the volume; the claim is deleted meanwhile.
// The same request is sent again to learn the volume's ID, and the volume is deleted: no
// PersistentVolume is made for a claim that is gone, and nothing is left in the driver.
func TestATimedOutCreateVolumeOfAClaimDeletedMeanwhileIsUndone(t *testing.T) {
	w := newWorld(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 600 * time.Millisecond}},
		func(c *config) { c.opts.timeout = 150 * time.Millisecond },
		class("fast", nil), claimFor("data", "uid-1", "fast"))
	w.waitFor("a timed-out CreateVolume", func() bool {
		return slices.ContainsFunc(w.events(), func(e string) bool { return strings.Contains(e, "DeadlineExceeded") })
	})
	if err := w.kube.CoreV1().PersistentVolumeClaims("ns").Delete(context.Background(), "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.driver.SetMethodLatency(testdriver.MethodCreateVolume, 0)
	w.waitFor("the volume deleted", func() bool {
		return len(w.calls(testdriver.MethodDeleteVolume)) > 0 && len(w.driver.Volumes()) == 0 && w.ctrl.inFlight.get("uid-1") == nil
	})
	for _, c := range w.calls(testdriver.MethodCreateVolume) {
		if c.VolumeName != "pvc-uid-1" {
			t.Errorf("CreateVolume with name %q", c.VolumeName)
		}
	}
	if w.pv("pvc-uid-1") != nil {
		t.Error("a PersistentVolume was saved for a claim that is gone")
	}
}

func TestAFinalErrorIsReportedAndRetriedWithBackoff(t *testing.T) {
	w := newWorld(t, testdriver.Config{}, nil, class("fast", nil))
	if err := w.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: codes.InvalidArgument, Times: 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.kube.CoreV1().PersistentVolumeClaims("ns").Create(context.Background(), claimFor("data", "uid-1", "fast"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the PersistentVolume", func() bool { return w.pv("pvc-uid-1") != nil })
	failed := 0
	for _, e := range w.events() {
		if strings.Contains(e, "ProvisioningFailed") && strings.Contains(e, "InvalidArgument") {
			failed++
		}
	}
	if failed != 2 {
		t.Errorf("%d ProvisioningFailed events, want 2", failed)
	}
}

func TestADriverWithoutCreateDeleteVolumeGetsAClearEvent(t *testing.T) {
	w := newWorld(t, testdriver.Config{ControllerCapabilities: []csi.ControllerServiceCapability_RPC_Type{csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME}},
		nil, class("fast", nil), claimFor("data", "uid-1", "fast"))
	w.waitFor("the event", func() bool {
		return slices.ContainsFunc(w.events(), func(e string) bool { return strings.Contains(e, "does not support dynamic provisioning") })
	})
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 0 {
		t.Errorf("%d CreateVolume calls", n)
	}
}

// P1: intake ending while CreateVolume runs does not cancel it; the PersistentVolume is
// still written, and run returns only after.
func TestStoppingIntakeLetsTheCreateVolumeInFlightFinishAndBeRecorded(t *testing.T) {
	w := newWorld(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 500 * time.Millisecond}},
		nil, class("fast", nil), claimFor("data", "uid-1", "fast"))
	w.waitFor("CreateVolume in flight", func() bool { return len(w.calls(testdriver.MethodCreateVolume)) == 1 })
	w.stopIntake()
	<-w.done
	if w.pv("pvc-uid-1") == nil {
		t.Fatal("run returned without recording the volume created in flight")
	}
	c := w.calls(testdriver.MethodCreateVolume)[0]
	if c.Canceled || !c.CallerGone.IsZero() || c.Code != "OK" {
		t.Errorf("CreateVolume %+v, want OK and waited for", c)
	}
}

func TestDelayedBindingWaitsForTheSelectedNodeAndReschedulesWhenItIsGone(t *testing.T) {
	sc := class("late", func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	})
	n1 := node("n1", map[string]string{testdriver.TopologyKey: "n1"})
	cn1 := csiNode("n1", testdriver.TopologyKey)
	w := newWorld(t, testdriver.Config{Topology: true}, nil, sc, n1, cn1, claimFor("data", "uid-1", "late"))
	ctx := context.Background()
	claims := w.kube.CoreV1().PersistentVolumeClaims("ns")

	// Without a node nothing happens; a node that does not exist is handed back.
	gone := claimFor("other", "uid-2", "late")
	gone.Annotations[volumehelpers.AnnSelectedNode] = "no-such-node"
	if _, err := claims.Create(ctx, gone, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the selected node removed", func() bool {
		c, err := claims.Get(ctx, "other", metav1.GetOptions{})
		_, selected := c.Annotations[volumehelpers.AnnSelectedNode]
		return err == nil && !selected
	})
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 0 {
		t.Fatalf("%d CreateVolume calls before a node was selected", n)
	}

	c, err := claims.Get(ctx, "data", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c.Annotations[volumehelpers.AnnSelectedNode] = "n1"
	if _, err := claims.Update(ctx, c, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the PersistentVolume", func() bool { return w.pv("pvc-uid-1") != nil })
	affinity := w.pv("pvc-uid-1").Spec.NodeAffinity
	if affinity == nil || affinity.Required.NodeSelectorTerms[0].MatchExpressions[0].Values[0] != "n1" {
		t.Errorf("node affinity %+v, want the selected node's topology", affinity)
	}
}

func releasedPV(name, handle string, policy v1.PersistentVolumeReclaimPolicy, finalizers ...string) *v1.PersistentVolume {
	return &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: finalizers, Annotations: map[string]string{
			volumehelpers.AnnDynamicallyProvisioned: drv, request.AnnDeletionSecretName: "del-creds", request.AnnDeletionSecretNamespace: "ns",
		}},
		Spec: v1.PersistentVolumeSpec{
			PersistentVolumeReclaimPolicy: policy, StorageClassName: "fast",
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: handle}},
			ClaimRef:               &v1.ObjectReference{Namespace: "ns", Name: "gone", UID: "uid-gone"},
		},
		Status: v1.PersistentVolumeStatus{Phase: v1.VolumeReleased},
	}
}

// createVolume makes a volume in the driver as if it had been provisioned earlier.
func (w *world) createVolume(name string) string {
	w.t.Helper()
	resp, err := w.ctrl.csi.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}}})
	if err != nil {
		w.t.Fatal(err)
	}
	return resp.Volume.VolumeId
}

func TestReleasedVolumesWithReclaimDeleteAreDeletedAfterDetachAndRetainedOnesKept(t *testing.T) {
	secret := &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "del-creds", Namespace: "ns"}}
	w := newWorld(t, testdriver.Config{}, nil, class("fast", nil), secret)
	ctx := context.Background()
	fin := volumehelpers.PVDeletionProtectionFinalizer
	deleteID, retainID := w.createVolume("pvc-del"), w.createVolume("pvc-ret")
	va := &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: "va"}, Spec: storagev1.VolumeAttachmentSpec{
		Attacher: drv, NodeName: "n1", Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To("pvc-del")}}}
	if _, err := w.kube.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the attachment in the cache", func() bool { return w.ctrl.deleter.AttachedTo("pvc-del") == "n1" })
	for _, pv := range []*v1.PersistentVolume{releasedPV("pvc-del", deleteID, v1.PersistentVolumeReclaimDelete, fin), releasedPV("pvc-ret", retainID, v1.PersistentVolumeReclaimRetain, fin)} {
		if _, err := w.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	w.waitFor("the attached volume reported", func() bool {
		// As upstream v6.4: postponed, with a Normal event, not a failure.
		return slices.Contains(w.events(), "Normal VolumeDelete persistentvolume pvc-del is still attached to node n1, waiting for detach")
	})
	if n := len(w.calls(testdriver.MethodDeleteVolume)); n != 0 {
		t.Fatalf("%d DeleteVolume calls while attached", n)
	}
	if err := w.kube.StorageV1().VolumeAttachments().Delete(ctx, "va", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the Delete PersistentVolume gone", func() bool {
		_, err := w.kube.CoreV1().PersistentVolumes().Get(ctx, "pvc-del", metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	if _, ok := w.driver.Volume(deleteID); ok {
		t.Error("the volume of the Delete PersistentVolume is still in the driver")
	}
	w.waitFor("the Retain PersistentVolume without finalizer", func() bool {
		pv := w.pv("pvc-ret")
		return pv != nil && !slices.Contains(pv.Finalizers, fin)
	})
	if _, ok := w.driver.Volume(retainID); !ok {
		t.Error("the volume of the Retain PersistentVolume was deleted")
	}
	for _, c := range w.calls(testdriver.MethodDeleteVolume) {
		if c.VolumeID != deleteID {
			t.Errorf("DeleteVolume of %s", c.VolumeID)
		}
	}
}

func TestANodeDeploymentTakesFreeClaimsForItsNodeAndLeavesOtherNodesAlone(t *testing.T) {
	nd := &localNode{name: "n1", immediateBinding: true, baseDelay: 10 * time.Millisecond, maxDelay: 50 * time.Millisecond,
		failures: map[string]int{},
		info:     &csi.NodeGetInfoResponse{NodeId: "n1", AccessibleTopology: &csi.Topology{Segments: map[string]string{testdriver.TopologyKey: "n1"}}}}
	other := claimFor("other", "uid-2", "fast")
	other.Annotations[volumehelpers.AnnSelectedNode] = "n2"
	w := newWorld(t, testdriver.Config{Topology: true}, func(c *config) { c.node = nd }, class("fast", nil), claimFor("free", "uid-1", "fast"), other)
	ctx := context.Background()

	w.waitFor("the free claim provisioned on n1", func() bool { return w.pv("pvc-uid-1") != nil })
	c, err := w.kube.CoreV1().PersistentVolumeClaims("ns").Get(ctx, "free", metav1.GetOptions{})
	if err != nil || c.Annotations[volumehelpers.AnnSelectedNode] != "n1" {
		t.Fatalf("free claim %v, err %v: want selected node n1", c.Annotations, err)
	}
	if affinity := w.pv("pvc-uid-1").Spec.NodeAffinity; affinity == nil || affinity.Required.NodeSelectorTerms[0].MatchExpressions[0].Values[0] != "n1" {
		t.Errorf("affinity %+v, want n1", affinity)
	}

	// n2's volume is n2's to delete; n1's own released volume is deleted here.
	n2ID := w.createVolume("pvc-n2")
	n2 := releasedPV("pvc-n2", n2ID, v1.PersistentVolumeReclaimDelete, volumehelpers.PVDeletionProtectionFinalizer)
	n2.Spec.NodeAffinity = request.NodeAffinity([]*csi.Topology{{Segments: map[string]string{testdriver.TopologyKey: "n2"}}})
	if _, err := w.kube.CoreV1().PersistentVolumes().Create(ctx, n2, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Released as the PV controller releases it: its claim is gone (a claim left in
	// place would be provisioned again once the volume is deleted).
	own := w.pv("pvc-uid-1")
	ownID := own.Spec.CSI.VolumeHandle
	if err := w.kube.CoreV1().PersistentVolumeClaims("ns").Delete(ctx, "free", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	own.Status.Phase = v1.VolumeReleased
	if _, err := w.kube.CoreV1().PersistentVolumes().UpdateStatus(ctx, own, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("n1's volume deleted", func() bool {
		_, inDriver := w.driver.Volume(ownID)
		return w.pv("pvc-uid-1") == nil && !inDriver
	})
	if _, ok := w.driver.Volume(n2ID); !ok || w.pv("pvc-n2") == nil {
		t.Error("n1 deleted n2's volume")
	}
	for _, c := range w.calls(testdriver.MethodCreateVolume) {
		if c.VolumeName == "pvc-uid-2" {
			t.Error("n1 provisioned the claim selected for n2")
		}
	}
}

// refreshes records what the controller asks capacity tracking to refresh.
type refreshes struct {
	mu  sync.Mutex
	got []string
}

func (r *refreshes) Refresh(class string, topology []*csi.Topology) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var segments []string
	for _, tp := range topology {
		segments = append(segments, labels.Set(tp.GetSegments()).String())
	}
	r.got = append(r.got, class+"@"+strings.Join(segments, "|"))
}

func (r *refreshes) has(want string) bool { return r.count(want) > 0 }

func (r *refreshes) count(want string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, g := range r.got {
		if g == want {
			n++
		}
	}
	return n
}

func TestProvisioningAndDeletionRefreshTheCapacityTheyChanged(t *testing.T) {
	r := &refreshes{}
	w := newWorld(t, testdriver.Config{}, func(c *config) { c.capacity = r }, class("fast", nil), class("slow", nil))
	if err := w.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: codes.InvalidArgument, Times: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.kube.CoreV1().PersistentVolumeClaims("ns").Create(context.Background(), claimFor("data", "uid-1", "fast"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the PersistentVolume", func() bool { return w.pv("pvc-uid-1") != nil })
	// The failure refreshes the whole class; the volume (no topology here) too.
	w.waitFor("the refreshes of the failure and of the volume", func() bool { return r.count("fast@") == 2 })
	pv := releasedPV("pv-del", w.createVolume("del"), v1.PersistentVolumeReclaimDelete)
	pv.Spec.StorageClassName = "slow"
	pv.Spec.NodeAffinity = &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{
		{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "zone", Operator: v1.NodeSelectorOpIn, Values: []string{"a"}}}}}}}
	if _, err := w.kube.CoreV1().Secrets("ns").Create(context.Background(), &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "del-creds", Namespace: "ns"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.create(pv)
	w.waitFor("the deletion's refresh of its segment", func() bool { return r.has("slow@zone=a") })
}
