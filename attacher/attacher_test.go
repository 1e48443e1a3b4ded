package attacher

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	"github.com/spf13/pflag"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"
	"k8s.io/component-base/featuregate"

	"github.com/csi-sidecars/csi-sidecars/attacher/csicall"
	"github.com/csi-sidecars/csi-sidecars/attacher/finalizer"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// The flags, their defaults and the Lease name are upstream external-attacher's (P9).
func TestFlagsHaveUpstreamNamesAndDefaults(t *testing.T) {
	fs := pflag.NewFlagSet("attacher", pflag.ContinueOnError)
	New().AddFlags(fs)
	want := map[string]string{
		"timeout":              "15s",
		"worker-threads":       "10",
		"resync":               "10m0s",
		"retry-interval-start": "1s",
		"retry-interval-max":   "5m0s",
		"max-entries":          "0",
		"reconcile-sync":       "1m0s",
		"default-fstype":       "",
		// --max-grpc-log-length is a shared flag of the core (lifecycle), default -1.
	}
	// Ours: the split of --worker-threads between the attach and detach queues; 0 is
	// --worker-threads, so an upstream manifest keeps its meaning.
	ours := map[string]string{
		"attach-worker-threads": "0",
		"detach-worker-threads": "0",
	}
	for name, def := range ours {
		f := fs.Lookup(name)
		if f == nil || f.DefValue != def {
			t.Errorf("flag --%s: %+v, want default %q", name, f, def)
		}
	}
	for name, def := range want {
		f := fs.Lookup(name)
		if f == nil {
			t.Errorf("flag --%s missing", name)
			continue
		}
		if f.DefValue != def {
			t.Errorf("--%s default %q, want %q", name, f.DefValue, def)
		}
	}
	fs.VisitAll(func(f *pflag.Flag) {
		if _, ok := want[f.Name]; !ok && ours[f.Name] == "" {
			t.Errorf("flag --%s is neither upstream's nor one of ours", f.Name)
		}
	})
	if got := lifecycle.SanitizeName(New().LeaseName("csi.example.com")); got != "external-attacher-leader-csi-example-com" {
		t.Errorf("Lease name %q", got)
	}
	if got := finalizer.Name("csi.example.com"); got != "external-attacher/csi-example-com" {
		t.Errorf("finalizer %q", got)
	}
	spec := New().Features()[MutableCSINodeAllocatableCount]
	if !spec.Default || spec.PreRelease != featuregate.GA {
		t.Errorf("MutableCSINodeAllocatableCount %+v, want GA and on", spec)
	}
}

func TestValidateFlags(t *testing.T) {
	tests := []struct {
		args    []string
		wantErr string
	}{
		{nil, ""},
		// Upstream refuses only this one.
		{[]string{"--worker-threads=0"}, "--worker-threads"},
		// Upstream accepts these; a warning says what they do.
		{[]string{"--timeout=0"}, ""},
		{[]string{"--retry-interval-start=0"}, ""},
		{[]string{"--retry-interval-start=10s", "--retry-interval-max=1s"}, ""},
		{[]string{"--max-entries=-1"}, ""},
		{[]string{"--reconcile-sync=0"}, ""},
		{[]string{"--resync=-1s"}, ""},
		// Ours: more workers of a kind than --worker-threads only wait for slots.
		{[]string{"--worker-threads=4", "--attach-worker-threads=8"}, ""},
		{[]string{"--detach-worker-threads=2"}, ""},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			s := New()
			fs := pflag.NewFlagSet("attacher", pflag.ContinueOnError)
			s.AddFlags(fs)
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			err := s.ValidateFlags()
			if (tc.wantErr == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.wantErr)) {
				t.Errorf("error %v, want one naming %q", err, tc.wantErr)
			}
		})
	}
}

// What the driver reports decides the handler, readonly, access modes and the reconciler.
func TestConfigFromCapabilities(t *testing.T) {
	controller := rpc.PluginCapabilitySet{csi.PluginCapability_Service_CONTROLLER_SERVICE: true}
	caps := func(c ...csi.ControllerServiceCapability_RPC_Type) rpc.ControllerCapabilitySet {
		set := rpc.ControllerCapabilitySet{}
		for _, x := range c {
			set[x] = true
		}
		return set
	}
	const (
		publish  = csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME
		readonly = csi.ControllerServiceCapability_RPC_PUBLISH_READONLY
		snmw     = csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER
		list     = csi.ControllerServiceCapability_RPC_LIST_VOLUMES
		nodes    = csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES
	)
	tests := []struct {
		name   string
		plugin rpc.PluginCapabilitySet
		caps   rpc.ControllerCapabilitySet
		want   config
	}{
		{"no controller service: trivial", rpc.PluginCapabilitySet{}, caps(publish), config{trivial: true}},
		{"no PUBLISH_UNPUBLISH_VOLUME: trivial", controller, caps(list, nodes), config{trivial: true, reconcile: true}},
		{"publish only", controller, caps(publish), config{}},
		{"readonly and single-node multi-writer", controller, caps(publish, readonly, snmw), config{publishReadOnly: true, singleNodeMultiWriter: true}},
		{"LIST_VOLUMES without published nodes: no reconciler", controller, caps(publish, list), config{}},
		{"LIST_VOLUMES with published nodes: reconciler", controller, caps(publish, list, nodes), config{reconcile: true}},
	}
	off := New()
	if off.config(&lifecycle.Env{PluginCapabilities: controller, ControllerCapabilities: caps(publish, list, nodes)}).reconcile {
		t.Errorf("--reconcile-sync=0 left the reconciler on; upstream would list without pause")
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := New()
			s.opts.reconcileSync = time.Minute
			got := s.config(&lifecycle.Env{PluginCapabilities: tc.plugin, ControllerCapabilities: tc.caps})
			if got.trivial != tc.want.trivial || got.publishReadOnly != tc.want.publishReadOnly ||
				got.singleNodeMultiWriter != tc.want.singleNodeMultiWriter || got.reconcile != tc.want.reconcile {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestShouldEnqueueVAChange(t *testing.T) {
	base := newVA("va", "pv")
	base.ResourceVersion = "1"
	change := func(mutate func(*storagev1.VolumeAttachment)) *storagev1.VolumeAttachment {
		va := base.DeepCopy()
		va.ResourceVersion = "2"
		mutate(va)
		return va
	}
	withAttachError := change(func(va *storagev1.VolumeAttachment) { va.Status.AttachError = &storagev1.VolumeError{Message: "x"} })
	tests := []struct {
		name     string
		old, new *storagev1.VolumeAttachment
		want     bool
	}{
		{"periodic resync", base, base.DeepCopy(), true},
		{"spec or metadata change", base, change(func(va *storagev1.VolumeAttachment) { va.Finalizers = []string{"f"} }), true},
		{"only our attachError was written", base, withAttachError, false},
		{"only our detachError was written", base, change(func(va *storagev1.VolumeAttachment) { va.Status.DetachError = &storagev1.VolumeError{Message: "x"} }), false},
		{"error and deletion at once", base, change(func(va *storagev1.VolumeAttachment) {
			va.Status.AttachError = &storagev1.VolumeError{Message: "x"}
			deleting(va)
		}), true},
		{"error cleared with attached", withAttachError, change(func(va *storagev1.VolumeAttachment) { va.ResourceVersion = "3"; va.Status.Attached = true }), true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := shouldEnqueueVAChange(tc.old, tc.new); got != tc.want {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}
}

// P1: intake ending does not cancel an in-flight publish; Run returns only after the
// publish finished and its result was recorded, and nothing queued is started after.
func TestRunFinishesInFlightPublishAfterIntakeEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		backend, err := testdriver.New(testdriver.Config{})
		if err != nil {
			t.Fatal(err)
		}
		client := csi.NewControllerClient(serve(t, backend))
		id1, id2 := createVolume(t, client, "vol-1"), createVolume(t, client, "vol-2")
		backend.SetMethodLatency(testdriver.MethodControllerPublishVolume, 500*time.Millisecond)
		cfg := defaultConfig()
		cfg.workers = 1
		f := newFixture(t, cfg, backend, newPV("pv-1", id1), newPV("pv-2", id2), newVA("va-1", "pv-1"), newVA("va-2", "pv-2"), newCSINode(testNode, testNodeID))

		intake, stop := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { f.ctrl.run(intake); close(done) }()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := backend.WaitFor(ctx, func(c []testdriver.Call) bool {
			return countCalls(c, testdriver.MethodControllerPublishVolume) == 1
		}); err != nil {
			t.Fatal(err)
		}
		stop()
		<-done
		var attached int
		for _, name := range []string{"va-1", "va-2"} {
			if f.va(name).Status.Attached {
				attached++
			}
		}
		calls := backend.Journal()
		if n := countCalls(calls, testdriver.MethodControllerPublishVolume); n != 1 || attached != 1 {
			t.Errorf("%d publishes, %d attached; want the one in flight finished and recorded, the other not started", n, attached)
		}
		for _, c := range calls {
			if c.Method == testdriver.MethodControllerPublishVolume && (c.Canceled || !c.CallerGone.IsZero() || c.Code != "OK") {
				t.Errorf("in-flight publish: %+v", c)
			}
		}
	})
}

// The reconciler forces a sync of VolumeAttachments the driver disagrees with, paging
// through ListVolumes by --max-entries; the forced sync publishes again.
func TestReconcilerRepairsDisagreement(t *testing.T) {
	backend, err := testdriver.New(testdriver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	client := csi.NewControllerClient(serve(t, backend))
	ids := []string{createVolume(t, client, "a"), createVolume(t, client, "b"), createVolume(t, client, "c")}
	cfg := defaultConfig()
	cfg.maxEntries = 1
	objs := []runtime.Object{newCSINode(testNode, testNodeID)}
	for i, id := range ids {
		objs = append(objs, newPV(fmt.Sprintf("pv-%d", i), id), newVA(fmt.Sprintf("va-%d", i), fmt.Sprintf("pv-%d", i)))
	}
	// va-0 says attached but the driver lost it; va-1 is attached in both; va-2 is not
	// attached in either.
	for i := range 2 {
		objs[1+2*i].(*corev1.PersistentVolume).Finalizers = []string{ourFinalizer}
		attachedWith(ourFinalizer)(objs[2+2*i].(*storagev1.VolumeAttachment))
		objs[2+2*i].(*storagev1.VolumeAttachment).Status.AttachmentMetadata = map[string]string{testdriver.PublishContextDevicePath: "/dev/testdriver/" + ids[i]}
	}
	f := newFixture(t, cfg, backend, objs...)
	publishDirectly(t, f, ids[1], testNodeID)

	if err := f.ctrl.reconciler.Once(); err != nil {
		t.Fatal(err)
	}
	if n := countCalls(backend.Journal(), testdriver.MethodListVolumes); n != 3 {
		t.Errorf("%d ListVolumes calls, want 3 pages of 1", n)
	}
	f.ctrl.forced.mu.Lock()
	forced := fmt.Sprint(f.ctrl.forced.names)
	f.ctrl.forced.mu.Unlock()
	if forced != "map[va-0:true]" {
		t.Fatalf("forced syncs %s, want va-0 only", forced)
	}
	key := "va-0"
	if err := f.sync(key); err != nil {
		t.Fatal(err)
	}
	if v, _ := backend.Volume(ids[0]); !v.Published[testNodeID] && len(v.Published) == 0 {
		t.Errorf("va-0's volume not published again: %v", v.Published)
	}
	if len(f.writes()) != 0 {
		// Upstream sends an empty patch here.
		t.Errorf("writes %q, want none: the status was already right", f.writes())
	}
	if f.ctrl.forced.consume(key) {
		t.Error("force sync not consumed")
	}
}

// A VolumeAttachment the reconciler flagged and that is deleted before its sync leaves no
// forced sync behind: its deletion forgets it, and so does a sync that finds it gone (the
// reconciler may flag it from its list after the deletion went by). Otherwise each such
// name stays in memory for the life of the process.
func TestForcedSyncOfDeletedVolumeAttachmentIsForgotten(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	// Attached in its status, but the driver has no publication: the reconciler flags it.
	f := newFixture(t, defaultConfig(), backend,
		newPV("pv", volID, withFinalizer), newVA("va", "pv", attachedWith("other/finalizer")), newCSINode(testNode, testNodeID))
	if err := f.ctrl.reconciler.Once(); err != nil {
		t.Fatal(err)
	}
	if got := f.forced(); got != "map[va:true]" {
		t.Fatalf("forced syncs %s, want va", got)
	}
	if err := f.kube.StorageV1().VolumeAttachments().Delete(context.Background(), "va", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the deletion to forget the forced sync", func() bool { return f.forced() == "map[]" })

	for name, run := range map[string]func() error{
		"sync":   func() error { return f.sync("va") },
		"worker": func() error { return f.ctrl.processVA(context.Background(), attachKind, "va") },
	} {
		f.ctrl.forced.set("va") // flagged from a list read before the deletion
		if err := run(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if got := f.forced(); got != "map[]" {
			t.Errorf("after a %s that found the VolumeAttachment gone, forced syncs %s, want none", name, got)
		}
	}
}

// forced is the controller's forced syncs, printed.
func (f *fixture) forced() string {
	f.ctrl.forced.mu.Lock()
	defer f.ctrl.forced.mu.Unlock()
	return fmt.Sprint(f.ctrl.forced.names)
}

func countCalls(calls []testdriver.Call, method string) int {
	return len(testdriver.CallsOf(calls, method))
}

// Upstream's attacher records no Events: failed attaches and detaches are recorded in the
// VolumeAttachment's status only (kube-controller-manager turns a failed attach into an
// Event on the Pod). The sidecar as the core builds it, with the process's broadcaster,
// records none either, final driver errors included.
func TestFailuresAreRecordedInStatusNotEvents(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	kube := fake.NewClientset(
		newPV("pv", volID, withFinalizer), newCSINode(testNode, testNodeID),
		newVA("attach", "pv"),
		newVA("detach", "pv", attachedWith(ourFinalizer), deleting),
	)
	factory := informers.NewSharedInformerFactory(kube, 0)
	events := &recordingBroadcaster{recorder: record.NewFakeRecorder(100)}
	env := lifecycle.Env{
		Kube: kube, Informers: factory, Events: events, CSI: serve(t, backend), DriverName: testDriver,
		PluginCapabilities:     rpc.PluginCapabilitySet{csi.PluginCapability_Service_CONTROLLER_SERVICE: true},
		ControllerCapabilities: rpc.ControllerCapabilitySet{csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME: true},
	}.WithOps(context.Background())
	s := New()
	fs := pflag.NewFlagSet("attacher", pflag.ContinueOnError)
	s.AddFlags(fs)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Setup(env); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	defer close(stop)
	factory.Start(stop)
	factory.WaitForCacheSync(stop)
	for _, fault := range []testdriver.Fault{
		{Method: testdriver.MethodControllerPublishVolume, Code: codes.NotFound},
		{Method: testdriver.MethodControllerUnpublishVolume, Code: codes.Internal},
	} {
		if err := backend.InjectFault(fault); err != nil {
			t.Fatal(err)
		}
	}

	if err := s.ctrl.syncVA("attach"); err == nil {
		t.Error("attach: sync returned nil, want the driver's error")
	}
	if err := s.ctrl.syncVA("detach"); err == nil {
		t.Error("detach: sync returned nil, want the driver's error")
	}

	for name, got := range map[string]func(storagev1.VolumeAttachmentStatus) *storagev1.VolumeError{
		"attach": func(s storagev1.VolumeAttachmentStatus) *storagev1.VolumeError { return s.AttachError },
		"detach": func(s storagev1.VolumeAttachmentStatus) *storagev1.VolumeError { return s.DetachError },
	} {
		va, err := kube.StorageV1().VolumeAttachments().Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if ve := got(va.Status); ve == nil || !strings.Contains(ve.Message, "injected") {
			t.Errorf("%s: status %+v, want the driver's error recorded", name, va.Status)
		}
	}
	if n := len(events.recorder.Events); n != 0 || events.recorders != 0 {
		t.Errorf("%d events from %d recorders, want none: upstream records no Events", n, events.recorders)
	}
}

// recordingBroadcaster hands out one FakeRecorder and counts the recorders asked for; the
// embedded broadcaster is nil, nothing else of it is used.
type recordingBroadcaster struct {
	record.EventBroadcaster
	recorder  *record.FakeRecorder
	recorders int
}

func (b *recordingBroadcaster) NewRecorder(*runtime.Scheme, corev1.EventSource) record.EventRecorderLogger {
	b.recorders++
	return b.recorder
}

// The attacher's queues report their backlog to the core (Env.Backlog), which exports it as
// csi_sidecars_queue_waiting_items{sidecar,queue}: a VolumeAttachment queued and not yet
// taken by a worker is counted on its queue.
func TestQueuesReportTheirBacklog(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	kube := fake.NewClientset(standard()(volID)...)
	factory := informers.NewSharedInformerFactory(kube, 0)
	backlog := &lifecycle.Backlog{}
	env := lifecycle.Env{
		Kube: kube, Informers: factory, CSI: serve(t, backend), DriverName: testDriver, Backlog: backlog,
		PluginCapabilities:     rpc.PluginCapabilitySet{csi.PluginCapability_Service_CONTROLLER_SERVICE: true},
		ControllerCapabilities: rpc.ControllerCapabilitySet{csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME: true},
	}.WithOps(context.Background())
	s := New()
	fs := pflag.NewFlagSet("attacher", pflag.ContinueOnError)
	s.AddFlags(fs)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Setup(env); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	defer close(stop)
	factory.Start(stop)
	factory.WaitForCacheSync(stop)

	waiting := func() map[string]int {
		out := map[string]int{}
		for _, q := range backlog.Now(time.Now()) {
			out[q.Queue] = q.Waiting
		}
		return out
	}
	waitFor(t, "the VolumeAttachment counted", func() bool { return waiting()["csi-attacher-va"] == 1 })
	if got, ok := waiting()["csi-attacher-pv"]; !ok || got != 0 {
		t.Errorf("backlog %v, want the PV queue reported, empty", waiting())
	}
}

// Without --max-entries the reconciler still pages (csicall.ListPage per page): one answer with
// every volume would exceed gRPC's message limit in a large cluster.
func TestReconcilerPagesWithoutMaxEntries(t *testing.T) {
	backend, err := testdriver.New(testdriver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	client := csi.NewControllerClient(serve(t, backend))
	for i := range csicall.ListPage + 1 {
		createVolume(t, client, fmt.Sprintf("v-%d", i))
	}
	cfg := defaultConfig()
	cfg.maxEntries = 0
	f := newFixture(t, cfg, backend, newCSINode(testNode, testNodeID))
	if err := f.ctrl.reconciler.Once(); err != nil {
		t.Fatal(err)
	}
	if n := countCalls(backend.Journal(), testdriver.MethodListVolumes); n != 2 {
		t.Errorf("%d ListVolumes calls for %d volumes, want 2 pages", n, csicall.ListPage+1)
	}
}
