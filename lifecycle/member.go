package lifecycle

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/leaderelection"
	rl "k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// fenceGrace is how long a fenced sidecar gets to return from Run once its Ops() context is
// cancelled, before the process exits without it.
const fenceGrace = 3 * time.Second

// member is one hosted sidecar: its Env, its Ops() context and, with leader election, its
// own Lease.
type member struct {
	sidecar   Sidecar
	env       *Env
	csi       *fencedConn
	ops       context.Context
	cancelOps context.CancelFunc

	leaseName string
	lock      *guardedLock
	watch     *leaseWatch
	elector   *leaderelection.HealthzAdaptor
	leKube    kubernetes.Interface

	inflightAtDriverLoss atomic.Int64
}

func (p *process) newMember(ctx context.Context, s Sidecar, shared Env, conn *grpc.ClientConn, cfg *rest.Config) (*member, error) {
	m := &member{sidecar: s}
	// Ops() outlives the signal on purpose (P1); only fencing and the drain deadline end it.
	m.ops, m.cancelOps = context.WithCancel(context.WithoutCancel(ctx))
	p.metrics.leader.WithLabelValues(s.Name()).Set(0)
	inflight := p.metrics.inflight.WithLabelValues(s.Name())
	m.csi = &fencedConn{conn: conn, ops: m.ops, onChange: func(d int64) { inflight.Add(float64(d)) }}
	shared.CSI = m.csi
	m.env = shared.WithOps(m.ops)

	if p.opts.LeaderElection {
		leKube, err := kubernetes.NewForConfig(p.opts.leaderElectionConfig(cfg))
		if err != nil {
			return nil, fmt.Errorf("creating the leader-election client: %w", err)
		}
		m.leKube = leKube
		m.leaseName = SanitizeName(s.LeaseName(shared.DriverName))
		lock, err := rl.NewWithLabels(rl.LeasesResourceLock, p.opts.LeaderElectionNamespace, m.leaseName,
			leKube.CoreV1(), leKube.CoordinationV1(), rl.ResourceLockConfig{
				Identity:      p.opts.LeaderElectionIdentity,
				EventRecorder: leaseEventRecorder(ctx, leKube, p.opts.LeaderElectionNamespace, m.leaseName, p.opts.LeaderElectionIdentity),
			}, p.opts.LeaderElectionLabels)
		if err != nil {
			return nil, fmt.Errorf("creating the Lease lock %s/%s: %w", p.opts.LeaderElectionNamespace, m.leaseName, err)
		}
		m.lock = &guardedLock{Interface: lock}
		m.watch = newLeaseWatch(p.opts.LeaderElectionIdentity)
		m.elector = p.health.newElectorCheck()
	}
	if err := s.Setup(m.env); err != nil {
		return nil, fmt.Errorf("setting up %s: %w", s.Name(), err)
	}
	return m, nil
}

// leaseEventRecorder records "became leader" / "stopped leading" on the Lease, as upstream.
func leaseEventRecorder(ctx context.Context, kube kubernetes.Interface, namespace, lease, identity string) record.EventRecorder {
	b := record.NewBroadcaster(record.WithContext(ctx))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: kube.CoreV1().Events(namespace)})
	return b.NewRecorder(scheme.Scheme, v1.EventSource{Component: lease + "/" + identity})
}

// campaign is the member's whole life after set-up: lead at once without leader election;
// else stand by until the Lease is free, take it, lead. It returns the member's exit code.
func (m *member) campaign(ctx context.Context, p *process) int {
	logger := klog.FromContext(ctx).WithValues("sidecar", m.sidecar.Name())
	ctx = klog.NewContext(ctx, logger)
	if !p.opts.LeaderElection {
		r := m.lead(ctx, p, context.Background(), nil)
		return r.code
	}
	if err := m.watch.start(ctx, p.intake, m.leKube, p.opts.LeaderElectionNamespace, m.leaseName); err != nil {
		logger.Info("Stopped before watching the Lease", "reason", err.Error())
		return p.exitCode(ExitOK)
	}
	for {
		logger.Info("Standing by for the Lease", "lease", p.opts.LeaderElectionNamespace+"/"+m.leaseName, "identity", p.opts.LeaderElectionIdentity)
		if !acquire(p.intake, m.lock, m.watch, p.opts.LeaseDuration, p.opts.RetryPeriod) {
			// A standby has nothing in flight: it exits 0 at once (P4).
			logger.Info("Standby stopping")
			return p.exitCode(ExitOK)
		}
		logger.Info("Acquired the Lease", "lease", m.leaseName)
		if code, done := m.hold(ctx, p); done {
			return code
		}
	}
}

// result is how a leader's term ended.
type result struct {
	code    int
	release bool // empty the Lease holder before exit
}

// hold runs client-go's LeaderElector on a Lease this replica has just taken: it renews the
// Lease, calls lead, and on return releases the Lease (ReleaseOnCancel) unless the guarded
// lock was closed. done is false when another replica won the Lease before this one led.
func (m *member) hold(ctx context.Context, p *process) (code int, done bool) {
	logger := klog.FromContext(ctx)
	electorCtx, cancelElector := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelElector()
	started := make(chan struct{})
	results := make(chan result, 1)
	lostRace := make(chan struct{})
	var lostRaceOnce sync.Once

	elector, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:            m.lock,
		LeaseDuration:   p.opts.LeaseDuration,
		RenewDeadline:   p.opts.RenewDeadline,
		RetryPeriod:     p.opts.RetryPeriod,
		ReleaseOnCancel: true,
		Name:            m.leaseName,
		WatchDog:        m.elector,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(leading context.Context) {
				if electorCtx.Err() != nil {
					return
				}
				close(started)
				m.watch.setLeading(true)
				results <- m.lead(ctx, p, leading, m.watch.takenOver)
			},
			// lead() sees the end of leadership through its context.
			OnStoppedLeading: func() {},
			OnNewLeader: func(identity string) {
				if identity != p.opts.LeaderElectionIdentity {
					lostRaceOnce.Do(func() { close(lostRace) })
				}
			},
		},
	})
	if err != nil {
		logger.Error(err, "Invalid leader election configuration")
		return ExitUsage, true
	}
	m.elector.SetLeaderElection(elector)
	electorDone := make(chan struct{})
	go func() {
		defer close(electorDone)
		elector.Run(electorCtx)
	}()

	select {
	case <-started:
	case <-lostRace:
		logger.Info("Another replica took the Lease first")
		cancelElector()
		<-electorDone
		return ExitOK, false
	case <-p.intake.Done():
		// Stopped in the moment between taking the Lease and leading. The elector holds it
		// already, so it starts leading within one renew; the term then ends at once on the
		// normal path, which releases the Lease (a standby takes over without waiting).
		timer := time.NewTimer(p.opts.RenewDeadline)
		defer timer.Stop()
		select {
		case <-started:
		case <-lostRace:
			cancelElector()
			<-electorDone
			return p.exitCode(ExitOK), true
		case <-timer.C:
			m.lock.close()
			cancelElector()
			<-electorDone
			select {
			case <-started: // it began leading after all; its result says how it ended
				return (<-results).code, true
			default:
				return p.exitCode(ExitOK), true
			}
		}
	}
	r := <-results
	release := r.release && p.opts.Gates.Enabled(ReleaseLeaderElectionOnExit)
	if !release {
		m.lock.close()
	}
	cancelElector() // client-go's ReleaseOnCancel empties the holder unless the lock is closed
	<-electorDone
	if release {
		logger.Info("Released the Lease", "lease", m.leaseName)
	} else {
		logger.Info("Leaving the Lease to expire", "lease", m.leaseName)
	}
	return r.code, true
}

// lead runs the sidecar while this replica leads and drains it on shutdown. leading ends
// when client-go stops renewing the Lease; takenOver closes when the watch sees another
// holder. Both mean the Lease is lost.
func (m *member) lead(ctx context.Context, p *process, leading context.Context, takenOver <-chan struct{}) result {
	logger := klog.FromContext(ctx)
	name := m.sidecar.Name()
	leader := p.metrics.leader.WithLabelValues(name)
	leader.Set(1)
	defer leader.Set(0)

	intake, stopIntake := context.WithCancel(klog.NewContext(leading, logger))
	defer stopIntake()
	defer context.AfterFunc(p.intake, stopIntake)()
	done := make(chan error, 1)
	logger.Info("Leading: starting work")
	go func() { done <- m.sidecar.Run(intake, m.env) }()

	select {
	case err := <-done:
		if p.intake.Err() == nil && leading.Err() == nil {
			// The sidecar gave up on its own; nothing of it runs any more.
			if err == nil {
				err = errReturnedEarly
			}
			logger.Error(err, "Sidecar stopped while leading")
			return result{code: ExitError, release: true}
		}
		if leading.Err() != nil {
			return m.fence(ctx, p, stopIntake, nil, "lost the Lease")
		}
		return m.drained(ctx, p, err)
	case <-leading.Done():
		return m.fence(ctx, p, stopIntake, done, "lost the Lease")
	case <-takenOver:
		return m.fence(ctx, p, stopIntake, done, "another replica holds the Lease")
	case <-p.drainExpired.Done():
		return m.fence(ctx, p, stopIntake, done, fmt.Sprintf("drain did not finish within --drain-timeout=%v", p.opts.DrainTimeout))
	}
}

// drained ends a term whose Run returned after intake stopped: every in-flight operation
// ended on its own (P1, P2).
func (m *member) drained(ctx context.Context, p *process, runErr error) result {
	logger := klog.FromContext(ctx)
	elapsed := p.drainTime()
	if p.isDriverLost() {
		// Calls that were running when the driver went away may still be running in it;
		// only an idle leader may hand over at once. A call that failed with Unavailable
		// counts as running: it may have been cut off just before the loss was noticed.
		idle := m.inflightAtDriverLoss.Load() == 0 && !m.csi.broken.Load()
		logger.Info("Stopped after losing the CSI driver", "idleAtLoss", idle)
		return result{code: ExitError, release: idle}
	}
	p.metrics.drainDuration.WithLabelValues(m.sidecar.Name(), "released").Observe(elapsed.Seconds())
	if runErr != nil {
		logger.Error(runErr, "Sidecar returned an error while draining")
		return result{code: ExitError, release: true}
	}
	logger.Info("Drained: every in-flight operation finished", "drainDuration", elapsed.Round(time.Millisecond).String())
	return result{code: ExitOK, release: true}
}

// fence stops work that may no longer run here: intake and every CSI call are cancelled at
// once, the Lease is not released (P3, P6). done, when not nil, is waited on briefly so the
// sidecar can record what it can.
func (m *member) fence(ctx context.Context, p *process, stopIntake context.CancelFunc, done <-chan error, why string) result {
	klog.FromContext(ctx).Error(nil, "Cancelling all in-flight operations", "reason", why, "inFlight", m.csi.InFlight())
	if m.lock != nil {
		m.lock.close()
	}
	stopIntake()
	m.cancelOps()
	if p.intake.Err() != nil && p.drainExpired.Err() != nil {
		p.metrics.drainDuration.WithLabelValues(m.sidecar.Name(), "deadline").Observe(p.drainTime().Seconds())
	}
	if done != nil {
		timer := time.NewTimer(fenceGrace)
		defer timer.Stop()
		select {
		case <-done:
		case <-timer.C:
			klog.FromContext(ctx).Info("Sidecar did not return after fencing; exiting without it", "sidecar", m.sidecar.Name())
		}
	}
	return result{code: ExitError, release: false}
}
