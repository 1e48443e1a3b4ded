package attacher

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/csi-sidecars/csi-sidecars/attacher/finalizer"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// A freed slot goes to the worker that has waited longest; a worker whose intake ends while
// it waits leaves the line holding nothing, and none starts once intake has ended.
func TestSlotsGoToTheLongestWaiting(t *testing.T) {
	s := newSlots(1)
	ctx := context.Background()
	if !s.acquire(ctx) {
		t.Fatal("first acquire failed with a slot free")
	}
	got := make(chan string, 3)
	wait := func(ctx context.Context, name string) {
		before := s.waiters()
		go func() {
			if s.acquire(ctx) {
				got <- name
			} else {
				got <- name + " gave up"
			}
		}()
		waitFor(t, name+" in line", func() bool { return s.waiters() == before+1 })
	}
	wait(ctx, "first")
	cancelled, cancel := context.WithCancel(ctx)
	wait(cancelled, "cancelled")
	wait(ctx, "third")

	cancel()
	if g := <-got; g != "cancelled gave up" {
		t.Fatalf("%q, want the cancelled waiter to give up first", g)
	}
	s.release()
	if g := <-got; g != "first" {
		t.Errorf("%q took the freed slot, want the longest waiting", g)
	}
	s.release()
	if g := <-got; g != "third" {
		t.Errorf("%q took the freed slot, want third", g)
	}
	s.release()
	if s.free != 1 || s.waiters() != 0 {
		t.Errorf("%d free, %d waiting after every slot came back; want 1 and 0", s.free, s.waiters())
	}
	ended, end := context.WithCancel(ctx)
	end()
	if s.acquire(ended) {
		t.Error("a slot was taken after intake ended")
	}
}

func (s *slots) waiters() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.waiting)
}

// A VolumeAttachment deleted while its publish runs is not unpublished by a detach worker
// meanwhile: the detach worker is turned away, and the attach worker hands the
// VolumeAttachment to the detach queue when its publish is recorded. The driver sees the
// unpublish start after the publish ended, and the volume ends unpublished.
func TestDeletionDuringPublishWaitsForIt(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	cfg := defaultConfig()
	cfg.reconcile = false // its forced syncs would add calls of their own
	f := newFixture(t, cfg, backend, standard()(volID)...)
	gate := f.gate()
	f.start()

	publish := gate.next(t)
	if publish.method != "publish" {
		t.Fatalf("first call %s, want the publish", publish.method)
	}
	va := f.va("va")
	deleting(va)
	if _, err := f.kube.StorageV1().VolumeAttachments().Update(context.Background(), va, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// A detach worker takes it while the publish runs: it must be turned away, not call
	// the driver.
	waitFor(t, "a detach worker to take it", func() bool {
		f.ctrl.guard.mu.Lock()
		defer f.ctrl.guard.mu.Unlock()
		return f.ctrl.guard.turnedAway["va"] || len(gate.calls) > 0
	})
	if len(gate.calls) > 0 {
		c := gate.next(t)
		t.Fatalf("%s of %s called while the publish ran", c.method, c.volume)
	}
	close(publish.release)
	unpublish := gate.next(t)
	if unpublish.method != "unpublish" {
		t.Fatalf("call after the publish %s, want the unpublish", unpublish.method)
	}
	close(unpublish.release)
	waitFor(t, "our finalizer removed", func() bool {
		va, err := f.kube.StorageV1().VolumeAttachments().Get(context.Background(), "va", metav1.GetOptions{})
		return err == nil && !finalizer.Has(va.Finalizers, ourFinalizer)
	})

	var published, unpublished testdriver.Call
	for _, c := range backend.Journal() {
		switch c.Method {
		case testdriver.MethodControllerPublishVolume:
			published = c
		case testdriver.MethodControllerUnpublishVolume:
			unpublished = c
		}
	}
	if published.End.IsZero() || unpublished.Start.Before(published.End) {
		t.Errorf("driver: publish %v-%v, unpublish from %v; want the unpublish after the publish ended", published.Start, published.End, unpublished.Start)
	}
	if o := backend.Overlaps(); len(o) != 0 {
		t.Errorf("driver saw overlapping operations: %+v", o)
	}
	if v, _ := backend.Volume(volID); len(v.Published) != 0 {
		t.Errorf("driver: still published to %v", v.Published)
	}
}

// With every slot (--worker-threads) held by detaches and more detaches queued, a new
// attach takes the first slot a detach frees: it waits for one running detach, not for the
// queued burst.
func TestAttachTakesTheFirstSlotADetachFrees(t *testing.T) {
	const burst = 4
	f, client := newBurstFixture(t, burst, func(cfg *config) { cfg.workers = 2 })
	gate := f.gate()
	f.start()
	first, second := gate.next(t), gate.next(t)
	if first.method != "unpublish" || second.method != "unpublish" {
		t.Fatalf("calls %s, %s; want two unpublishes holding both slots", first.method, second.method)
	}

	id := f.createAttachment(client, "new")
	waitFor(t, "the attach worker waiting for a slot", func() bool { return f.ctrl.slots.waiters() == 1 })
	close(first.release)
	third := gate.next(t)
	if third.method != "publish" || third.volume != id {
		t.Errorf("call after the first detach ended: %s of %s, want the publish of %s", third.method, third.volume, id)
	}
	close(third.release)
	close(second.release)
	for range burst - 2 {
		close(gate.next(t).release)
	}
	waitFor(t, "va-new attached", func() bool { return f.va("va-new").Status.Attached })
}

// --detach-worker-threads below --worker-threads keeps the other slots for attaches: one
// starts while the detaches hold every detach worker.
func TestDetachWorkersBelowWorkerThreadsLeaveSlotsForAttaches(t *testing.T) {
	f, client := newBurstFixture(t, 3, func(cfg *config) {
		cfg.workers = 2
		cfg.detachWorkers = 1
	})
	gate := f.gate()
	f.start()
	detach := gate.next(t)
	if detach.method != "unpublish" {
		t.Fatalf("first call %s, want an unpublish", detach.method)
	}
	id := f.createAttachment(client, "new")
	if c := gate.next(t); c.method != "publish" || c.volume != id {
		t.Errorf("call while the detach runs: %s of %s, want the publish of %s", c.method, c.volume, id)
	} else {
		close(c.release)
	}
	close(detach.release)
	for range 2 {
		close(gate.next(t).release)
	}
	waitFor(t, "va-new attached", func() bool { return f.va("va-new").Status.Attached })
}

// newBurstFixture is a controller (reconciler off: its forced syncs would add calls of
// their own) with n attached VolumeAttachments being deleted, va-0 to va-<n-1>.
func newBurstFixture(t *testing.T, n int, mutate func(*config)) (*fixture, csi.ControllerClient) {
	t.Helper()
	backend, err := testdriver.New(testdriver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	client := csi.NewControllerClient(serve(t, backend))
	objs := []runtime.Object{newCSINode(testNode, testNodeID)}
	for i := range n {
		id := createVolume(t, client, fmt.Sprintf("gone-%d", i))
		objs = append(objs, newPV(fmt.Sprintf("pv-%d", i), id, withFinalizer), newVA(fmt.Sprintf("va-%d", i), fmt.Sprintf("pv-%d", i), attachedWith(ourFinalizer), deleting))
	}
	cfg := defaultConfig()
	cfg.reconcile = false
	mutate(&cfg)
	return newFixture(t, cfg, backend, objs...), client
}

// createAttachment creates a volume, its PV pv-<name> and a VolumeAttachment va-<name> of
// it, and returns the volume's ID.
func (f *fixture) createAttachment(client csi.ControllerClient, name string) string {
	f.t.Helper()
	id := createVolume(f.t, client, name)
	if _, err := f.kube.CoreV1().PersistentVolumes().Create(context.Background(), newPV("pv-"+name, id), metav1.CreateOptions{}); err != nil {
		f.t.Fatal(err)
	}
	waitFor(f.t, "the PV in the cache", func() bool { _, err := f.ctrl.pvLister.Get("pv-" + name); return err == nil })
	if _, err := f.kube.StorageV1().VolumeAttachments().Create(context.Background(), newVA("va-"+name, "pv-"+name), metav1.CreateOptions{}); err != nil {
		f.t.Fatal(err)
	}
	return id
}

// needsWork, by which a standby queues and a worker takes a slot, is true exactly when a
// sync calls the driver or writes.
func TestNeedsWorkMirrorsSync(t *testing.T) {
	for _, tc := range []struct {
		name    string
		va      func(*storagev1.VolumeAttachment)
		trivial bool
		forced  bool
	}{
		{name: "not attached", va: func(*storagev1.VolumeAttachment) {}},
		{name: "attached", va: attachedWith(ourFinalizer)},
		{name: "attached without our finalizer", va: attachedWith("other/finalizer")},
		{name: "attached, forced", va: attachedWith(ourFinalizer), forced: true},
		{name: "deleted with our finalizer", va: func(va *storagev1.VolumeAttachment) { attachedWith(ourFinalizer)(va); deleting(va) }},
		{name: "deleted without our finalizer, status attached", va: func(va *storagev1.VolumeAttachment) { attachedWith("other/finalizer")(va); deleting(va) }},
		{name: "deleted without our finalizer, detached", va: func(va *storagev1.VolumeAttachment) { va.Finalizers = []string{"other/finalizer"}; deleting(va) }},
		{name: "trivial, not attached", va: func(*storagev1.VolumeAttachment) {}, trivial: true},
		{name: "trivial, attached", va: func(va *storagev1.VolumeAttachment) { va.Status.Attached = true }, trivial: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			backend, volID := newBackendWithVolume(t)
			cfg := defaultConfig()
			cfg.trivial = tc.trivial
			f := newFixture(t, cfg, backend, newPV("pv", volID, withFinalizer), newVA("va", "pv", tc.va), newCSINode(testNode, testNodeID))
			publishDirectly(t, f, volID, testNodeID)
			if tc.forced {
				f.ctrl.forced.set("va")
			}
			cached, err := f.ctrl.vaLister.Get("va")
			if err != nil {
				t.Fatal(err)
			}
			want := f.ctrl.needsWork(cached)
			f.csi.mu.Lock()
			f.csi.publishes, f.csi.unpublishes = nil, nil
			f.csi.mu.Unlock()
			if err := f.sync("va"); err != nil {
				t.Fatal(err)
			}
			p, u := f.csi.counts()
			if did := p+u+len(f.writes()) > 0; did != want {
				t.Errorf("needsWork %v, but the sync made %d CSI calls and writes %q", want, p+u, f.writes())
			}
		})
	}
}

// A standby queues only the VolumeAttachments that need work, each on the queue of its
// kind, as csi_sidecars_queue_waiting_items shows: at a takeover the new leader starts on
// them, not behind a no-op sync of every settled one. Once it leads, its periodic resync
// queues a settled VolumeAttachment again, as upstream.
func TestStandbyQueuesOnlyVolumeAttachmentsThatNeedWork(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	cfg := defaultConfig()
	backlog := &lifecycle.Backlog{}
	cfg.backlog = backlog
	other := func(va *storagev1.VolumeAttachment) { va.Spec.Attacher = "other.csi.example.com" }
	f := newFixture(t, cfg, backend,
		newPV("pv", volID, withFinalizer), newCSINode(testNode, testNodeID),
		newVA("to-attach", "pv"),
		newVA("settled-1", "pv", attachedWith(ourFinalizer)),
		newVA("settled-2", "pv", attachedWith(ourFinalizer)),
		newVA("to-detach", "pv", attachedWith(ourFinalizer), deleting),
		// Being deleted, but our finalizer is gone: detached already.
		newVA("detached", "pv", attachedWith("other/finalizer"), deleting),
		newVA("other-driver", "pv", other),
	)
	waiting := func() map[string]int {
		got := map[string]int{}
		for _, q := range backlog.Now(time.Now()) {
			got[q.Queue] = q.Waiting
		}
		return got
	}
	want := func(attach, detach int) {
		t.Helper()
		if got := waiting(); got[vaQueueName] != attach || got[vaDetachQueueName] != detach || got[pvQueueName] != 0 {
			t.Errorf("waiting items %v, want %d to attach, %d to detach, no PV", got, attach, detach)
		}
	}
	// The handler gets its events in order: once a VolumeAttachment created now is queued,
	// it has seen every one listed at the start.
	if _, err := f.kube.StorageV1().VolumeAttachments().Create(context.Background(), newVA("last", "pv"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the new VolumeAttachment queued", func() bool { return waiting()[vaQueueName] >= 2 })
	want(2, 1)

	// A resync of a settled VolumeAttachment while standing by: nothing to do.
	settled := f.va("settled-1")
	f.ctrl.vaUpdated(settled, settled)
	want(2, 1)
	// A settled VolumeAttachment that gets deleted needs work again.
	deleting(settled)
	if _, err := f.kube.StorageV1().VolumeAttachments().Update(context.Background(), settled, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "settled-1 queued for its detach", func() bool {
		return f.ctrl.detachQueue.Len() == 2
	})
	want(2, 2)

	// Leading: the periodic resync queues the settled one, as upstream.
	f.ctrl.leading.Store(true)
	settled = f.va("settled-2")
	f.ctrl.vaUpdated(settled, settled)
	want(3, 2)
}

// gatedClient holds every publish and unpublish at the driver's door until the test lets
// it in, and tells the test which call is waiting. Once opened (at the test's end) it lets
// every call through.
type gatedClient struct {
	csi.ControllerClient
	calls  chan *gatedCall
	opened chan struct{}
}

type gatedCall struct {
	method, volume string
	release        chan struct{}
}

// gate puts a gatedClient in front of the controller's driver client.
func (f *fixture) gate() *gatedClient {
	g := &gatedClient{ControllerClient: f.ctrl.calls.Client, calls: make(chan *gatedCall, 100), opened: make(chan struct{})}
	f.ctrl.calls.Client = g
	f.gated = g
	return g
}

// start runs the controller's workers until the test ends; then the gate, if any, opens so
// that calls the test did not wait for end.
func (f *fixture) start() {
	intake, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { f.ctrl.run(intake); close(done) }()
	f.t.Cleanup(func() {
		if f.gated != nil {
			close(f.gated.opened)
		}
		stop()
		<-done
	})
}

func (g *gatedClient) wait(ctx context.Context, method, volume string) {
	select {
	case <-g.opened:
		return
	default:
	}
	c := &gatedCall{method: method, volume: volume, release: make(chan struct{})}
	g.calls <- c
	select {
	case <-c.release:
	case <-g.opened:
	case <-ctx.Done():
	}
}

// next is the next call at the door.
func (g *gatedClient) next(t *testing.T) *gatedCall {
	t.Helper()
	select {
	case c := <-g.calls:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("no CSI call came")
		return nil
	}
}

func (g *gatedClient) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest, opts ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error) {
	g.wait(ctx, "publish", req.VolumeId)
	return g.ControllerClient.ControllerPublishVolume(ctx, req, opts...)
}

func (g *gatedClient) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest, opts ...grpc.CallOption) (*csi.ControllerUnpublishVolumeResponse, error) {
	g.wait(ctx, "unpublish", req.VolumeId)
	return g.ControllerClient.ControllerUnpublishVolume(ctx, req, opts...)
}
