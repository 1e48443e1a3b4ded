package lifecycle

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/leaderelection"
	rl "k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/connrotation"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle/budget"
	"github.com/csi-sidecars/csi-sidecars/lifecycle/lease"
)

// fenceGrace is how long a fenced sidecar gets to return from Run once its Ops() context is
// cancelled, before the process exits without it.
const fenceGrace = 3 * time.Second

// ending is how a leader's term ended.
type ending int

const (
	endDrained           ending = iota // Run returned after intake stopped, without error
	endRunFailed                       // Run returned an error after intake stopped
	endReturnedEarly                   // Run returned while intake was still open
	endStoppedEarly                    // the process stopped between taking the Lease and leading
	endDriverLostIdle                  // the driver went away with no call in flight
	endDriverLostBusy                  // the driver went away while calls were in flight
	endDrainDeadline                   // --drain-timeout ran out; calls were cancelled
	endDrainDeadlineIdle               // --drain-timeout ran out with no call in the driver; writes were cancelled
	endLeaseLost                       // renewals failed, the renew deadline passed, or another record was written
	endStandbyStopped                  // stopped without leading: a standby, or during start-up
	endStandbyDriverLost               // the driver went away while not leading
)

// leaseFate is what an ending does with the Lease.
type leaseFate int

const (
	leaseReleased leaseFate = iota // the holder is emptied: a standby takes over at once
	leaseKept                      // left to expire: calls of the term may still run in the driver
	leaseNotOurs                   // another record is in it: not ours to write
	leaseNotHeld                   // this replica does not hold it
)

func (f leaseFate) String() string {
	return [...]string{"released", "kept: it expires", "not ours: untouched", "untouched"}[f]
}

// endings decides, in one place, what each ending means for the process: its exit code and
// the Lease. The Lease is released only when nothing this term started can still be
// running in the driver: Run has returned, so every worker has finished its call. Otherwise
// it is left to expire, so that no other replica calls the driver for a volume while the
// driver may still work on this one's call (P3, P6, P11). A lost Lease is not ours to write
// at all. The table of docs/promises.md is this one (TestThePromisesShowTheEndingsTable).
var endings = [...]struct {
	code  int
	lease leaseFate
	// outcome is the label of csi_sidecars_drain_duration_seconds when the Lease is kept.
	outcome string
	// what is the row's first column in docs/promises.md.
	what string
}{
	endDrained:       {ExitOK, leaseReleased, "", "clean drain after SIGTERM/SIGINT"},
	endStoppedEarly:  {ExitOK, leaseReleased, "", "the process stopped between taking the Lease and leading"},
	endRunFailed:     {ExitError, leaseReleased, "", "the sidecar returned an error while draining (its workers have returned)"},
	endReturnedEarly: {ExitError, leaseReleased, "", "the sidecar returned on its own while leading (its workers have returned)"},
	// Only API writes were left (throttled, or an API server that does not answer): the
	// next leader redoes them, and nothing of this term runs in the driver (P14).
	endDrainDeadlineIdle: {ExitError, leaseReleased, "", "`--drain-timeout` ran out with no call in the driver (API writes left)"},
	endDriverLostIdle:    {ExitError, leaseReleased, "", "CSI driver lost while no call was in flight"},
	endDriverLostBusy:    {ExitError, leaseKept, "driver_lost", "CSI driver lost (also during a drain) while calls were in flight"},
	endDrainDeadline:     {ExitError, leaseKept, "deadline", "`--drain-timeout` ran out with calls in the driver"},
	endLeaseLost:         {ExitError, leaseNotOurs, "lease_lost", "Lease lost: renew deadline passed, client-go gave up, or another record was written"},
	endStandbyStopped:    {ExitOK, leaseNotHeld, "", "a standby stopping (or a replica stopped during start-up)"},
	endStandbyDriverLost: {ExitError, leaseNotHeld, "", "CSI driver lost while not leading"},
}

// endingsTable is the endings table in Markdown, as docs/promises.md shows it.
func endingsTable() string {
	var b strings.Builder
	b.WriteString("| term ended by | exit | Lease |\n|---|---|---|\n")
	for _, e := range endings {
		fmt.Fprintf(&b, "| %s | %d | %s |\n", e.what, e.code, e.lease)
	}
	return b.String()
}

// driverLossOf is the row of an ending when the CSI driver was lost meanwhile: an ending
// that would be clean was the driver's loss. (A leader's term tells the loss apart itself,
// with or without calls in flight.)
func (p *process) driverLossOf(end ending) ending {
	if !p.isDriverLost() {
		return end
	}
	switch end {
	case endStandbyStopped:
		return endStandbyDriverLost
	case endStoppedEarly, endDrained:
		return endDriverLostIdle
	}
	return end
}

// code is the exit code of an ending, by the table.
func (p *process) code(end ending) int { return endings[p.driverLossOf(end)].code }

// member is one hosted sidecar: its Env, its Ops() context and, with leader election, its
// own Lease.
type member struct {
	sidecar   Sidecar
	env       *Env
	csi       *fencedConn
	ops       context.Context
	cancelOps context.CancelFunc

	leaseName string
	lock      rl.Interface // the Lease; each term wraps it in a lease.TermLock
	watch     *lease.Watch
	elector   *leaderelection.HealthzAdaptor
	// leaseConns dials the Lease client's connections, so that a renewal that timed out
	// can drop them (lease.NewTermLock's newConns).
	leaseConns *connrotation.Dialer
	// watchKube watches the Lease: the same budget as the Lease lock's client but no
	// request timeout, which would cut the watch every half renew deadline.
	watchKube kubernetes.Interface

	// budget is the sidecar's API budget (nil: no limit), and leaseEvents records on the
	// Lease; close stops them.
	budget      *budget.Budget
	leaseEvents record.EventBroadcaster

	inflightAtDriverLoss atomic.Int64
}

func (p *process) newMember(ctx context.Context, s Sidecar, shared Env, conn *grpc.ClientConn, cfg *rest.Config) (_ *member, err error) {
	m := &member{sidecar: s}
	defer func() {
		if err != nil {
			m.close()
		}
	}()
	// Ops() outlives the signal on purpose (P1); only fencing and the drain deadline end it.
	m.ops, m.cancelOps = context.WithCancel(context.WithoutCancel(ctx))
	p.metrics.leader.WithLabelValues(s.Name()).Set(0)
	inflight := p.metrics.inflight.WithLabelValues(s.Name())
	m.csi = &fencedConn{conn: conn, ops: m.ops, calls: callCount{onChange: func(d int64) { inflight.Add(float64(d)) }}}
	shared.CSI = m.csi
	// Its queues hold what its handlers add until it leads: a standby's queue metrics
	// stay at zero, and a leader's waits count from its takeover.
	shared.Backlog = &Backlog{sidecar: s.Name(), standby: true}
	// Each sidecar writes through clients of its own, with its own --kube-api-qps and
	// --kube-api-burst budget, as when it ran in a container of its own: in one process
	// the sidecars neither share nor multiply their rate limits. The budget serves writes
	// that finish work before writes that start it (lifecycle/budget, P14).
	m.budget = budget.For(cfg.QPS, cfg.Burst, func() int { return int(m.csi.InFlight()) })
	own := p.rest.Client(cfg, s.Name(), m.budget)
	own.UserAgent = cfg.UserAgent + "/" + s.Name()
	kube, err := kubernetes.NewForConfig(withProtobuf(own))
	if err != nil {
		return nil, fmt.Errorf("creating the client of %s: %w", s.Name(), err)
	}
	shared.Kube = kube
	shared.RestConfig = own
	// Events too spend the sidecar's budget, as upstream's recorder spends its clientset's,
	// behind the writes that record results (P14).
	shared.Events = budget.NewEventBroadcaster(ctx, kube, "")
	m.env = shared.WithOps(m.ops)

	if p.opts.LeaderElection {
		m.leaseConns = connrotation.NewDialer((&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext)
		leCfg := p.rest.Client(p.opts.leaderElectionConfig(cfg), s.Name(), nil)
		leCfg.Dial = m.leaseConns.DialContext
		leKube, err := kubernetes.NewForConfig(leCfg)
		if err != nil {
			return nil, fmt.Errorf("creating the leader-election client: %w", err)
		}
		if m.watchKube, err = kubernetes.NewForConfig(withProtobuf(p.rest.Client(cfg, s.Name(), nil))); err != nil {
			return nil, fmt.Errorf("creating the Lease watch client: %w", err)
		}
		m.leaseName = SanitizeName(s.LeaseName(shared.DriverName))
		m.lock, err = rl.NewWithLabels(rl.LeasesResourceLock, p.opts.LeaderElectionNamespace, m.leaseName,
			leKube.CoreV1(), leKube.CoordinationV1(), rl.ResourceLockConfig{
				Identity:      p.opts.LeaderElectionIdentity,
				EventRecorder: m.leaseEventRecorder(ctx, leKube, p.opts.LeaderElectionNamespace, p.opts.LeaderElectionIdentity),
			}, p.opts.LeaderElectionLabels)
		if err != nil {
			return nil, fmt.Errorf("creating the Lease lock %s/%s: %w", p.opts.LeaderElectionNamespace, m.leaseName, err)
		}
		m.watch = lease.NewWatch(p.opts.LeaderElectionIdentity)
		m.elector = p.health.newElectorCheck()
	}
	if err := s.Setup(m.env); err != nil {
		return nil, fmt.Errorf("setting up %s: %w", s.Name(), err)
	}
	return m, nil
}

// leaseEventRecorder records "became leader" / "stopped leading" on the Lease, as upstream.
func (m *member) leaseEventRecorder(ctx context.Context, kube kubernetes.Interface, namespace, identity string) record.EventRecorder {
	m.leaseEvents = budget.NewEventBroadcaster(ctx, kube, namespace)
	return m.leaseEvents.NewRecorder(scheme.Scheme, v1.EventSource{Component: m.leaseName + "/" + identity})
}

// close stops what the member runs besides its sidecar: the Lease watch, both event
// broadcasters, the Lease client's connections and, last, the budget the writes wait on. The run calls it as it
// returns, once every campaign has ended, so that a process that embeds the core keeps
// none of their goroutines. Events not yet written are dropped, as at a process's exit.
func (m *member) close() {
	if m.watch != nil {
		m.watch.Stop()
	}
	if m.env != nil {
		m.env.Events.Shutdown()
	}
	if m.leaseEvents != nil {
		m.leaseEvents.Shutdown()
	}
	if m.leaseConns != nil {
		m.leaseConns.CloseAll() // the Lease client's own dialer: no transport cache keeps them
	}
	if m.budget != nil {
		m.budget.Stop()
	}
}

// campaign is the member's whole life after set-up: lead at once without leader election;
// else stand by until the Lease is free, take it, lead. It returns the member's exit code.
func (m *member) campaign(ctx context.Context, p *process) int {
	logger := klog.FromContext(ctx).WithValues("sidecar", m.sidecar.Name())
	ctx = klog.NewContext(ctx, logger)
	if !p.opts.LeaderElection {
		return m.finish(ctx, p, nil, m.lead(ctx, p, term{leading: context.Background()}))
	}
	if err := m.watch.Start(ctx, p.intake, m.watchKube, p.opts.LeaderElectionNamespace, m.leaseName, p.opts.RetryPeriod); err != nil {
		logger.Info("Stopped before watching the Lease", "reason", err.Error())
		return p.code(endStandbyStopped)
	}
	for {
		logger.Info("Standing by for the Lease", "lease", p.opts.LeaderElectionNamespace+"/"+m.leaseName, "identity", p.opts.LeaderElectionIdentity)
		// client-go renews through it every tick; it writes once per retry period, and
		// its acquire and first renewal, right after the write that took the Lease, need
		// no write of their own.
		lock := lease.NewTermLock(m.lock, lease.TimingOf(p.opts.RenewDeadline, p.opts.RetryPeriod), m.leaseConns.CloseAll)
		if !lease.Acquire(p.intake, lock, m.watch, p.opts.LeaseDuration, p.opts.RetryPeriod) {
			// A standby has nothing in flight: it exits 0 at once (P4).
			logger.Info("Standby stopping")
			return p.code(endStandbyStopped)
		}
		logger.Info("Acquired the Lease", "lease", m.leaseName)
		if end, ok := m.hold(ctx, p, lock); ok {
			return m.finish(ctx, p, lock, end)
		}
	}
}

// term is what a leader watches to know its Lease is lost. Without leader election the
// channels are nil and leading never ends.
type term struct {
	leading   context.Context // ended by client-go when it stops renewing
	takenOver <-chan struct{} // the watch saw a record other than this term's
	expired   <-chan struct{} // no renewal succeeded for --leader-election-renew-deadline
	lock      *lease.TermLock
}

// hold runs one term on a Lease this replica has just taken: client-go's LeaderElector
// renews it through lock while lead runs the sidecar. ok is false when the term ended
// before leading started (another replica won, or no renewal got through): nothing ran, so
// the replica stands by again.
func (m *member) hold(ctx context.Context, p *process, lock *lease.TermLock) (end ending, ok bool) {
	logger := klog.FromContext(ctx)
	electorCtx, cancelElector := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelElector()
	results := make(chan ending, 1)
	lostRace := make(chan struct{})
	var lostRaceOnce sync.Once
	// started is the one decision between "lead" and "abandon the term before leading".
	var startMu sync.Mutex
	started, abandoned := false, false
	abandon := func() bool {
		startMu.Lock()
		defer startMu.Unlock()
		abandoned = !started
		return abandoned
	}

	elector, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:          lock,
		LeaseDuration: p.opts.LeaseDuration,
		RenewDeadline: p.opts.RenewDeadline,
		// client-go tries every tick; the TermLock writes once per retry period while the
		// writes succeed, and at every tick after one failed (P11).
		RetryPeriod: lease.TimingOf(p.opts.RenewDeadline, p.opts.RetryPeriod).Tick,
		// Only TermLock.Release empties the holder, and only when the term's ending says so.
		ReleaseOnCancel: false,
		Name:            m.leaseName,
		WatchDog:        m.elector,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(leading context.Context) {
				startMu.Lock()
				if abandoned {
					startMu.Unlock()
					return
				}
				started = true
				startMu.Unlock()
				m.watch.Lead(lock.AcquiredAt())
				defer m.watch.Lead(time.Time{})
				results <- m.lead(ctx, p, term{leading: leading, takenOver: m.watch.TakenOver(), expired: lock.Expired(), lock: lock})
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
		// Options.Validate applies client-go's rules; this is a programming error.
		logger.Error(err, "Invalid leader election configuration")
		return endStoppedEarly, true
	}
	m.elector.SetLeaderElection(elector)
	electorDone := make(chan struct{})
	go func() {
		defer close(electorDone)
		elector.Run(electorCtx)
	}()
	stopElector := func() {
		lock.Close()
		cancelElector()
		<-electorDone
	}

	select {
	case <-p.intake.Done():
		if abandon() {
			stopElector()
			return endStoppedEarly, true
		}
	case <-lostRace:
		if abandon() {
			logger.Info("Another replica took the Lease first")
			stopElector()
			return 0, false
		}
	case <-lock.Expired():
		if abandon() {
			logger.Info("Could not renew the Lease after taking it; standing by again")
			stopElector()
			return 0, false
		}
	case end = <-results:
		stopElector()
		return end, true
	}
	end = <-results
	stopElector()
	return end, true
}

// lead runs the sidecar while this replica leads and drains it on shutdown. It returns how
// the term ended; it never writes the Lease.
func (m *member) lead(ctx context.Context, p *process, t term) ending {
	logger := klog.FromContext(ctx)
	name := m.sidecar.Name()
	leader := p.metrics.leader.WithLabelValues(name)
	leader.Set(1)
	defer leader.Set(0)

	intake, stopIntake := context.WithCancel(klog.NewContext(t.leading, logger))
	defer stopIntake()
	defer context.AfterFunc(p.intake, stopIntake)()
	// From the end of intake on, no new driver call starts (P14).
	defer context.AfterFunc(intake, m.csi.drain)()
	if why := m.waitForCaches(intake, p, t); why != "" {
		return m.fence(ctx, t, stopIntake, nil, endLeaseLost, why)
	}
	done := make(chan error, 1)
	logger.Info("Leading: starting work")
	m.env.Backlog.lead()
	go func() { done <- m.sidecar.Run(intake, m.env) }()

	select {
	case err := <-done:
		switch {
		case t.leading.Err() != nil:
			return m.fence(ctx, t, stopIntake, nil, endLeaseLost, "client-go stopped renewing the Lease")
		case p.intake.Err() == nil:
			if err == nil {
				err = errReturnedEarly
			}
			logger.Error(err, "Sidecar stopped while leading")
			return endReturnedEarly
		case p.isDriverLost():
			// Calls that were running when the driver went away may still be running in it;
			// only an idle leader may hand over at once. A call that failed with Unavailable
			// counts as running: it may have been cut off just before the loss was noticed.
			if m.inflightAtDriverLoss.Load() == 0 && !m.csi.broken.Load() {
				return endDriverLostIdle
			}
			return endDriverLostBusy
		case err != nil:
			logger.Error(err, "Sidecar returned an error while draining")
			return endRunFailed
		}
		return endDrained
	case <-t.leading.Done():
		return m.fence(ctx, t, stopIntake, done, endLeaseLost, "client-go stopped renewing the Lease")
	case <-t.takenOver:
		return m.fence(ctx, t, stopIntake, done, endLeaseLost, "the Lease holds another record")
	case <-t.expired:
		return m.fence(ctx, t, stopIntake, done, endLeaseLost, fmt.Sprintf("no renewal of the Lease succeeded within --leader-election-renew-deadline=%v", p.opts.RenewDeadline))
	case <-p.drainExpired.Done():
		end := endDrainDeadline
		if m.csi.idleAfterDrain() {
			end = endDrainDeadlineIdle
		}
		return m.fence(ctx, t, stopIntake, done, end, fmt.Sprintf("drain did not finish within --drain-timeout=%v", p.opts.DrainTimeout))
	}
}

// waitForCaches holds a term that starts after an API server outage until its caches have
// watched again since, or relisted (P7). The wait is bounded by the lease duration, as a
// collection whose watch cannot resume must not keep the sidecar from its other work, and
// it ends when intake does or the Lease is lost meanwhile; it returns why the Lease was
// lost, or "" to lead.
func (m *member) waitForCaches(intake context.Context, p *process, t term) string {
	waiting, stop := context.WithCancel(intake)
	defer stop()
	go func() {
		select {
		case <-t.takenOver:
		case <-t.expired:
		case <-waiting.Done():
		}
		stop()
	}()
	stale := p.caches.Current(waiting, p.opts.LeaseDuration)
	select {
	case <-t.takenOver:
		return "the Lease holds another record"
	case <-t.expired:
		return fmt.Sprintf("no renewal of the Lease succeeded within --leader-election-renew-deadline=%v", p.opts.RenewDeadline)
	default:
	}
	if t.leading.Err() != nil {
		return "client-go stopped renewing the Lease"
	}
	if len(stale) > 0 && intake.Err() == nil {
		klog.FromContext(intake).Info("Warning: leading with caches that have not watched again since the API server was unreachable", "collections", stale, "waited", p.opts.LeaseDuration)
	}
	return ""
}

// fence stops work that may no longer run here: intake and every CSI call are cancelled
// first, before anything that could wait, then the Lease writes stop (P3, P6, P11). done,
// when not nil, is waited on briefly so the sidecar can record what it can.
func (m *member) fence(ctx context.Context, t term, stopIntake context.CancelFunc, done <-chan error, end ending, why string) ending {
	stopIntake()
	m.cancelOps()
	if t.lock != nil {
		t.lock.Close()
	}
	logger := klog.FromContext(ctx)
	logger.Error(nil, "Fenced: cancelled all in-flight operations", "reason", why, "inFlight", m.csi.InFlight())
	if done != nil {
		timer := time.NewTimer(fenceGrace)
		defer timer.Stop()
		select {
		case <-done:
		case <-timer.C:
			logger.Info("Sidecar did not return after fencing; exiting without it", "sidecar", m.sidecar.Name())
		}
	}
	return end
}

// finish carries out what endings says for how the term ended: release the Lease or leave
// it to expire, record the drain, and return the member's exit code. lock is nil without
// leader election.
func (m *member) finish(ctx context.Context, p *process, lock *lease.TermLock, end ending) int {
	logger := klog.FromContext(ctx)
	end = p.driverLossOf(end)
	rule := endings[end]
	outcome := rule.outcome
	elapsed, stopping := p.drainTime()
	if end == endDrained && stopping {
		logger.Info("Drained: every in-flight operation finished", "drainDuration", elapsed.Round(time.Millisecond).String())
	}
	release := false
	switch {
	case lock == nil:
		outcome = "no_lease"
	case rule.lease != leaseReleased:
	case !p.opts.Gates.Enabled(ReleaseLeaderElectionOnExit):
		outcome = "kept"
	default:
		outcome, release = "released", true
	}
	// The drain is over: its figure is recorded before the Lease is written, so that
	// /metrics serves it while the release waits for the API server (the process exits
	// right after), and logged with how the Lease ended, whatever a scrape sees.
	drained := end != endStoppedEarly && stopping
	if drained {
		p.metrics.drainDuration.WithLabelValues(m.sidecar.Name(), outcome).Observe(elapsed.Seconds())
	}
	switch {
	case lock == nil:
	case rule.lease != leaseReleased:
		lock.Close()
		logger.Info("Leaving the Lease to expire: calls of this term may still run in the driver, or the Lease is no longer ours", "lease", m.leaseName)
	case !release:
		lock.Close()
		logger.Info("Leaving the Lease to expire (ReleaseLeaderElectionOnExit is off)", "lease", m.leaseName)
	default:
		releaseCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.opts.RenewDeadline)
		err := lock.Release(releaseCtx)
		cancel()
		if err != nil {
			outcome = "release_failed"
			logger.Error(err, "Could not release the Lease; it expires on its own", "lease", m.leaseName)
		} else {
			logger.Info("Released the Lease", "lease", m.leaseName)
		}
	}
	if drained {
		logger.Info("Drain ended", "outcome", outcome, "drainDuration", elapsed.Round(time.Millisecond).String(), "exitCode", rule.code)
	}
	return rule.code
}
