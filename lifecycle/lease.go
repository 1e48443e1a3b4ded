package lifecycle

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	rl "k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"
)

// errLockClosed is what the guarded lock answers once the core decided to keep the Lease.
var errLockClosed = errors.New("lease writes stopped: the Lease is left to expire")

// guardedLock is the Lease lock handed to client-go's LeaderElector. close() makes every
// later write fail, so the elector's release-on-cancel cannot empty the holder when the
// drain ran out of time or the Lease was lost (P3, P6): the Lease then expires on its own.
type guardedLock struct {
	rl.Interface
	mu     sync.Mutex
	closed bool
}

func (g *guardedLock) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = true
}

func (g *guardedLock) Create(ctx context.Context, r rl.LeaderElectionRecord) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return errLockClosed
	}
	return g.Interface.Create(ctx, r)
}

func (g *guardedLock) Update(ctx context.Context, r rl.LeaderElectionRecord) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return errLockClosed
	}
	return g.Interface.Update(ctx, r)
}

// leaseWatch keeps this replica's view of one Lease from a watch, timed by the local clock
// as client-go does (a holder's renewTime is another machine's clock). A standby uses it to
// try the Lease the moment it is released or expires (P7); a leader uses it to notice at
// once that another identity holds the Lease (P6).
type leaseWatch struct {
	identity string

	mu         sync.Mutex
	raw        []byte
	record     *rl.LeaderElectionRecord // nil while the Lease does not exist
	observedAt time.Time
	leading    bool
	changed    chan struct{}
	takenOver  chan struct{}
	tookOver   bool
}

func newLeaseWatch(identity string) *leaseWatch {
	return &leaseWatch{identity: identity, changed: make(chan struct{}, 1), takenOver: make(chan struct{})}
}

// start runs an informer on the one Lease until run ends and returns once it has synced,
// or when synced ends first. A draining leader keeps watching, so a takeover during the
// drain still fences it at once.
func (w *leaseWatch) start(run, synced context.Context, client kubernetes.Interface, namespace, name string) error {
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithNamespace(namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
		}))
	inf := factory.Coordination().V1().Leases().Informer()
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { w.observeLease(obj) },
		UpdateFunc: func(_, obj any) { w.observeLease(obj) },
		DeleteFunc: func(any) { w.observe(nil, nil, time.Now()) },
	})
	if err != nil {
		return err
	}
	factory.Start(run.Done())
	if !cache.WaitForCacheSync(synced.Done(), inf.HasSynced) {
		return synced.Err()
	}
	return nil
}

func (w *leaseWatch) observeLease(obj any) {
	lease, ok := obj.(*coordinationv1.Lease)
	if !ok {
		return
	}
	rec := rl.LeaseSpecToLeaderElectionRecord(&lease.Spec)
	raw, err := json.Marshal(*rec)
	if err != nil {
		return
	}
	w.observe(rec, raw, time.Now())
}

// observe records a version of the Lease seen at now (from the watch or a Get).
func (w *leaseWatch) observe(rec *rl.LeaderElectionRecord, raw []byte, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if rec != nil && bytes.Equal(raw, w.raw) {
		return
	}
	w.record, w.raw, w.observedAt = rec, raw, now
	if w.leading && rec != nil && rec.HolderIdentity != "" && rec.HolderIdentity != w.identity && !w.tookOver {
		w.tookOver = true
		close(w.takenOver)
	}
	select {
	case w.changed <- struct{}{}:
	default:
	}
}

// untilFree tells how long, by this replica's observation, until the Lease may be taken:
// zero when it is absent, released, held by this identity or expired.
func (w *leaseWatch) untilFree(now time.Time) time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.record == nil || w.record.HolderIdentity == "" || w.record.HolderIdentity == w.identity {
		return 0
	}
	expiry := w.observedAt.Add(time.Duration(w.record.LeaseDurationSeconds) * time.Second)
	return max(expiry.Sub(now), 0)
}

func (w *leaseWatch) setLeading(leading bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.leading = leading
}

// acquire waits until the Lease is free by the watch's account and takes it with a
// compare-and-swap write. It returns false when ctx ends first. Once it returns true this
// replica holds the Lease and client-go's LeaderElector, started next, renews it at once.
func acquire(ctx context.Context, lock rl.Interface, w *leaseWatch, leaseDuration, retryPeriod time.Duration) bool {
	logger := klog.FromContext(ctx)
	for {
		wait := w.untilFree(time.Now())
		if wait == 0 {
			err := tryAcquire(ctx, lock, w, leaseDuration)
			if err == nil {
				return true
			}
			logger.V(4).Info("Lease not acquired", "lock", lock.Describe(), "reason", err.Error())
			// Lost a race or the API server failed; the watch wakes us on the next change.
			wait = retryPeriod
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return false
		case <-w.changed:
		case <-timer.C:
		}
		timer.Stop()
	}
}

var errLeaseHeld = errors.New("lease is held by another replica")

// tryAcquire reads the Lease and, when it is free, writes this identity into it. The write
// carries the read's resourceVersion, so of two standbys racing only one wins.
func tryAcquire(ctx context.Context, lock rl.Interface, w *leaseWatch, leaseDuration time.Duration) error {
	now := time.Now()
	rec := rl.LeaderElectionRecord{
		HolderIdentity:       lock.Identity(),
		LeaseDurationSeconds: int(leaseDuration / time.Second),
		AcquireTime:          metav1.NewTime(now),
		RenewTime:            metav1.NewTime(now),
	}
	old, raw, err := lock.Get(ctx)
	if apierrors.IsNotFound(err) {
		return lock.Create(ctx, rec)
	}
	if err != nil {
		return err
	}
	w.observe(old, raw, now)
	if w.untilFree(now) > 0 {
		return errLeaseHeld
	}
	if old.HolderIdentity == lock.Identity() {
		rec.AcquireTime = old.AcquireTime
		rec.LeaderTransitions = old.LeaderTransitions
	} else {
		rec.LeaderTransitions = old.LeaderTransitions + 1
	}
	return lock.Update(ctx, rec)
}
