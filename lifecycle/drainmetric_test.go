package lifecycle

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes/fake"
	rl "k8s.io/client-go/tools/leaderelection/resourcelock"
	k8smetrics "k8s.io/component-base/metrics"

	"github.com/csi-sidecars/csi-sidecars/lifecycle/lease"
)

// csi_sidecars_drain_duration_seconds is recorded when the drain ends, before the Lease is
// written: the process exits right after the release, so /metrics must serve the figure
// while the release waits for the API server, or no scrape would ever read it.
func TestDrainFigureIsServedWhileTheLeaseIsReleased(t *testing.T) {
	ctx := context.Background()
	held := &heldRelease{Interface: newFakeLock(t, "replica-a"), reading: make(chan struct{}), answer: make(chan struct{})}
	lock := lease.NewTermLock(held, lease.Timing{RenewDeadline: time.Hour, Attempt: time.Minute}, nil)
	if !lease.Acquire(ctx, lock, lease.NewWatch("replica-a"), 15*time.Second, time.Second) {
		t.Fatal("the Lease was not acquired")
	}
	held.hold.Store(true)
	registry := k8smetrics.NewKubeRegistry()
	p := &process{opts: NewOptions(), metrics: newCoreMetrics(registry), intakeEnded: time.Now().Add(-1500 * time.Millisecond)}
	m := &member{sidecar: namedSidecar("test"), leaseName: "lease"}

	code := make(chan int, 1)
	go func() { code <- m.finish(ctx, p, lock, endDrained) }()
	<-held.reading // the release waits for the API server
	if n, sum := drainFigure(t, registry, "test", "released"); n != 1 || sum < 1.5 {
		t.Errorf("while the Lease is released: %v drains recorded, %vs in all; want 1 of at least 1.5s", n, sum)
	}
	close(held.answer)
	if c := <-code; c != ExitOK {
		t.Errorf("exit code %d, want %d", c, ExitOK)
	}
	if rec, _, err := held.Interface.Get(ctx); err != nil || rec.HolderIdentity != "" {
		t.Errorf("Lease record %+v (%v) after the release, want no holder", rec, err)
	}
}

// drainFigure is the count and sum of the sidecar's drain durations of outcome in reg.
func drainFigure(t *testing.T, reg k8smetrics.KubeRegistry, sidecar, outcome string) (uint64, float64) {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "csi_sidecars_drain_duration_seconds" {
			continue
		}
		for _, s := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range s.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["sidecar"] == sidecar && labels["outcome"] == outcome {
				return s.GetHistogram().GetSampleCount(), s.GetHistogram().GetSampleSum()
			}
		}
	}
	return 0, 0
}

// heldRelease is a Lease whose first read once hold is set, the release's, waits until
// answer is closed.
type heldRelease struct {
	rl.Interface
	hold    atomic.Bool
	once    sync.Once
	reading chan struct{}
	answer  chan struct{}
}

func (h *heldRelease) Get(ctx context.Context) (*rl.LeaderElectionRecord, []byte, error) {
	if h.hold.Load() {
		h.once.Do(func() {
			close(h.reading)
			<-h.answer
		})
	}
	return h.Interface.Get(ctx)
}

func newFakeLock(t *testing.T, identity string) rl.Interface {
	t.Helper()
	client := fake.NewClientset()
	lock, err := rl.New(rl.LeasesResourceLock, "ns", "lease", client.CoreV1(), client.CoordinationV1(), rl.ResourceLockConfig{Identity: identity})
	if err != nil {
		t.Fatal(err)
	}
	return lock
}

// namedSidecar is a sidecar that is only a name.
type namedSidecar string

func (s namedSidecar) Name() string                           { return string(s) }
func (namedSidecar) AddFlags(*pflag.FlagSet)                  {}
func (s namedSidecar) LeaseName(string) string                { return string(s) }
func (namedSidecar) Setup(*Env) error                         { return nil }
func (namedSidecar) Run(intake context.Context, _ *Env) error { <-intake.Done(); return nil }
