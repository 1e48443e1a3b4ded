package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kubernetes-csi/csi-lib-utils/connection"
	"github.com/kubernetes-csi/csi-lib-utils/metrics"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	k8smetrics "k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	csitrans "k8s.io/csi-translation-lib"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle/budget"
	"github.com/csi-sidecars/csi-sidecars/lifecycle/outage"
)

// Exit codes of a sidecar process.
const (
	ExitOK    = 0 // clean drain (Lease released), or a standby told to stop
	ExitError = 1 // drain deadline, Lease lost, driver lost, second signal, start-up failure
	ExitUsage = 2 // bad flags or a configuration the sidecar cannot run with
)

// informerResync is the shared factory's default resync. It must not be zero: client-go
// then ignores every handler's own period (--resync, --resync-period); a handler that asks
// for a shorter one before the factory starts lowers it for its informer.
const informerResync = 10 * time.Minute

// Run hosts the sidecars until the process should end and returns its exit code. It owns
// the process's one signal handler: the first SIGTERM/SIGINT starts the drain, the second
// exits at once with ExitError (P5). opts must have been validated.
func Run(ctx context.Context, opts *Options, sidecars ...Hosted) int {
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(signals)
	return RunWithSignals(ctx, opts, signals, func(code int) { klog.FlushAndExit(klog.ExitFlushTimeout, code) }, sidecars...)
}

// RunWithSignals is Run with the signals and the immediate exit supplied by the caller, for
// a process that owns its signal handling (and for tests that host sidecars in-process):
// the first value on signals starts the drain, the second calls exitNow(ExitError).
func RunWithSignals(ctx context.Context, opts *Options, signals <-chan os.Signal, exitNow func(code int), sidecars ...Hosted) int {
	p := &process{opts: opts, signals: signals, exitNow: exitNow}
	return p.run(ctx, sidecars)
}

// process is one sidecar process: what its sidecars share.
type process struct {
	opts    *Options
	signals <-chan os.Signal
	exitNow func(code int)

	// intake ends when the process starts to stop (first signal, driver lost, a sidecar
	// ended on its own): no new work. Only stop ends it.
	intake     context.Context
	stopIntake context.CancelFunc
	stopOnce   sync.Once
	// drainExpired ends --drain-timeout after intake ended.
	drainExpired context.Context
	expireDrain  context.CancelFunc

	mu          sync.Mutex
	intakeEnded time.Time
	driverLost  bool
	members     []*member

	metrics *coreMetrics
	rest    *budget.RESTMetrics
	health  *health
	// caches keeps the informers current through API server outages.
	caches *outage.Tracker
}

// stop ends intake for every sidecar and starts the drain clock, once.
func (p *process) stop(ctx context.Context, reason string) {
	p.stopOnce.Do(func() {
		klog.FromContext(ctx).Info("Stopping: taking no new work, draining in-flight operations", "reason", reason, "drainTimeout", p.opts.DrainTimeout)
		p.health.setNotReady("shutting down: draining in-flight operations")
		p.mu.Lock()
		p.intakeEnded = time.Now()
		p.mu.Unlock()
		p.stopIntake()
		time.AfterFunc(p.opts.DrainTimeout, p.expireDrain)
	})
}

func (p *process) run(ctx context.Context, hosted []Hosted) int {
	logger := klog.FromContext(ctx)
	leaders, servers := splitHosted(hosted)
	p.intake, p.stopIntake = context.WithCancel(context.WithoutCancel(ctx))
	p.drainExpired, p.expireDrain = context.WithCancel(context.WithoutCancel(ctx))
	// lifetime ends when run returns: the signal watcher and the driver connection watch
	// live until then, through the drain.
	lifetime, endLifetime := context.WithCancel(ctx)
	defer endLifetime()
	registry := k8smetrics.NewKubeRegistry()
	p.metrics = newCoreMetrics(registry)
	p.rest = budget.NewRESTMetrics(registry)
	registry.CustomMustRegister(newBacklogCollector(p.backlogs))
	p.health = &health{notReady: "starting"}
	// The CSI call metrics exist once the driver is connected; served from then on.
	var csiMetrics atomic.Pointer[metrics.CSIMetricsManager]
	gatherers := prometheus.Gatherers{registry, legacyregistry.DefaultGatherer, prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
		if mm := csiMetrics.Load(); mm != nil {
			return (*mm).GetRegistry().Gather()
		}
		return nil, nil
	})}
	go p.watchSignals(lifetime)
	var diag *diagnostics
	if addr := p.httpAddress(); addr != "" {
		d, stop, err := serveHTTP(ctx, addr, p.opts.MetricsPath, p.opts.EnablePprof, gatherers, p.health)
		if err != nil {
			logger.Error(err, "Cannot start the HTTP server")
			return ExitError
		}
		defer stop()
		diag = d
	}

	// Servers start at once, whatever the API server and the leaders' connection do: the
	// kubelet's probe of the driver and its registration need neither.
	recordCSI := func() metrics.CSIMetricsManager {
		if mm := csiMetrics.Load(); mm != nil {
			return *mm
		}
		return nil
	}
	onDriverName := func(name string) {
		// With leaders, their connection's manager records every CSI call of the process.
		if len(leaders) == 0 {
			mm := newCSIMetrics(name)
			csiMetrics.CompareAndSwap(nil, &mm)
		}
	}
	running := p.startServers(ctx, servers, len(hosted) == 1, diag, recordCSI, onDriverName)
	code := ExitOK
	if len(leaders) > 0 {
		code = p.runLeaders(ctx, lifetime, leaders, &csiMetrics)
		// Leaders that ended, or could not start, end the process: its Servers drain too.
		p.stop(ctx, "the leading sidecars ended")
	} else {
		p.health.setNotReady("")
	}
	return max(code, running.wait())
}

// runLeaders hosts the leading sidecars until they end and returns their worst exit code.
// The driver connection's call metrics are stored in csiMetrics once it is made.
func (p *process) runLeaders(ctx, lifetime context.Context, sidecars []Sidecar, csiMetrics *atomic.Pointer[metrics.CSIMetricsManager]) int {
	logger := klog.FromContext(ctx)
	// What watches the leaders' connection ends when they do.
	lifetime, endLifetime := context.WithCancel(lifetime)
	defer endLifetime()
	cfg, err := p.opts.restConfig()
	if err != nil {
		logger.Error(err, "Cannot build the Kubernetes client configuration")
		return ExitError
	}
	// Every client is built from cfg: their lists and watches wait out API server outages.
	p.caches = outage.New()
	p.caches.Wrap(cfg)
	// The shared informers' client is the hosted sidecars' together: its series carry
	// their names joined by commas (just the one name for a single sidecar).
	var names []string
	for _, s := range sidecars {
		names = append(names, s.Name())
	}
	sharedBudget := budget.For(cfg.QPS, cfg.Burst, nil)
	if sharedBudget != nil {
		defer sharedBudget.Stop()
	}
	kube, err := kubernetes.NewForConfig(withProtobuf(p.rest.Client(cfg, strings.Join(names, ","), sharedBudget)))
	if err != nil {
		logger.Error(err, "Cannot create the Kubernetes client")
		return ExitError
	}
	if err := p.waitForAPIServer(p.intake, kube); err != nil {
		logger.Info("Stopped while waiting for the API server", "reason", err.Error())
		return p.code(endStandbyStopped)
	}

	p.health.setNotReady("connecting to the CSI driver at " + p.opts.CSIAddress)
	// A process-wide setting of csi-lib-utils, as upstream: it caps the -v=5 logs of every
	// CSI call on the connection.
	connection.SetMaxGRPCLogLength(p.opts.MaxGRPCLogLength)
	drv, err := connectDriver(p.intake, lifetime, p.opts.CSIAddress, probeTimeout(sidecars), func() { p.onDriverLost(lifetime) })
	if err != nil {
		if p.intake.Err() != nil {
			logger.Info("Stopped while connecting to the CSI driver", "reason", err.Error())
			return p.code(endStandbyStopped)
		}
		logger.Error(err, "Cannot use the CSI driver")
		return ExitError
	}
	// The connection watch ends first: closing the connection is no loss of the driver.
	defer func() {
		endLifetime()
		drv.conn.Close()
	}()
	csiMetrics.Store(&drv.metrics)
	logger.Info("CSI driver ready", "driver", drv.name)

	transform := NewCacheTransform()
	factory := informers.NewSharedInformerFactoryWithOptions(kube, informerResync, informers.WithTransform(transform))
	// Informers, the shared ones and those a sidecar runs itself (Env.Done), live as long
	// as the process.
	stopInformers := make(chan struct{})
	defer close(stopInformers)
	shared := Env{
		RestConfig:             cfg,
		Informers:              factory,
		CacheTransform:         transform,
		DriverName:             drv.name,
		PluginCapabilities:     drv.pluginCapabilities,
		ControllerCapabilities: drv.controllerCapabilities,
		Metrics:                drv.metrics,
		Gates:                  p.opts.Gates,
		Identity:               p.opts.LeaderElectionIdentity,
		done:                   stopInformers,
	}
	var members []*member
	for _, s := range sidecars {
		m, err := p.newMember(ctx, s, shared, drv.conn, cfg)
		if err != nil {
			logger.Error(err, "Cannot set up the sidecar", "sidecar", s.Name())
			if IsUsageError(err) {
				return ExitUsage
			}
			return ExitError
		}
		members = append(members, m)
		// What the member started ends with the run, not with ctx (RunWithSignals may be
		// embedded in a longer-lived process, or in a test).
		defer m.close()
	}
	p.mu.Lock()
	p.members = members
	p.mu.Unlock()

	// Caches start on every replica, so a standby takes over from warm caches (P7).
	p.health.setNotReady("waiting for informer caches")
	factory.Start(stopInformers)
	for typ, ok := range factory.WaitForCacheSync(p.intake.Done()) {
		if !ok {
			logger.Info("Stopped while waiting for informer caches", "type", typ.String())
			return p.code(endStandbyStopped)
		}
	}
	p.health.setNotReady("")

	if p.opts.LogBacklogInterval > 0 {
		go wait.UntilWithContext(lifetime, func(ctx context.Context) { p.logBacklog(ctx) }, p.opts.LogBacklogInterval)
	}
	codes := make([]int, len(members))
	var wg sync.WaitGroup
	for i, m := range members {
		wg.Go(func() {
			codes[i] = m.campaign(ctx, p)
			// One sidecar ended: the others drain and release, and the process exits
			// with the worst code, so the kubelet restarts it; no half-dead process.
			p.stop(ctx, "sidecar "+m.sidecar.Name()+" ended")
		})
	}
	wg.Wait()
	code := ExitOK
	for _, c := range codes {
		code = max(code, c)
	}
	return code
}

// watchSignals turns the first signal into the drain and the second into an immediate
// exit, until ctx ends (the process is done).
func (p *process) watchSignals(ctx context.Context) {
	logger := klog.FromContext(ctx)
	var sig os.Signal
	select {
	case sig = <-p.signals:
	case <-ctx.Done():
		return
	}
	p.stop(ctx, "received "+sig.String())
	select {
	case sig = <-p.signals:
	case <-ctx.Done():
		return
	}
	logger.Info("Received a second signal: exiting now", "signal", sig.String())
	p.exitNow(ExitError)
}

// onDriverLost runs once when the CSI connection breaks, also during a drain: intake stops,
// and each leader notes whether calls were in flight, which decides whether it may release
// its Lease.
func (p *process) onDriverLost(ctx context.Context) {
	p.mu.Lock()
	p.driverLost = true
	for _, m := range p.members {
		m.inflightAtDriverLoss.Store(m.csi.InFlight())
	}
	p.mu.Unlock()
	klog.FromContext(ctx).Error(nil, "Lost connection to the CSI driver: taking no new work and exiting", "address", p.opts.CSIAddress)
	p.stop(ctx, "lost the CSI driver")
}

func (p *process) isDriverLost() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.driverLost
}

// backlogs are the hosted sidecars' backlogs.
func (p *process) backlogs() []*Backlog {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*Backlog, 0, len(p.members))
	for _, m := range p.members {
		out = append(out, m.env.Backlog)
	}
	return out
}

// logBacklog logs every queue that has items waiting (--log-backlog-interval).
func (p *process) logBacklog(ctx context.Context) {
	now := time.Now()
	for _, b := range p.backlogs() {
		for _, q := range b.Now(now) {
			if q.Waiting > 0 {
				klog.FromContext(ctx).Info("Backlog", "sidecar", b.sidecar, "queue", q.Queue, "waiting", q.Waiting, "oldest", q.Oldest.Round(time.Millisecond).String())
			}
		}
	}
}

// drainTime is the time since intake ended; ok is false while it has not.
func (p *process) drainTime() (time.Duration, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.intakeEnded.IsZero() {
		return 0, false
	}
	return time.Since(p.intakeEnded), true
}

func (p *process) httpAddress() string {
	if p.opts.HTTPEndpoint != "" {
		return p.opts.HTTPEndpoint
	}
	return p.opts.MetricsAddress
}

// waitForAPIServer retries with backoff until the API server answers, reporting each
// failure in the log and on /readyz.
func (p *process) waitForAPIServer(ctx context.Context, kube kubernetes.Interface) error {
	p.health.setNotReady("waiting for the API server")
	backoff := wait.Backoff{Duration: 500 * time.Millisecond, Factor: 2, Jitter: 0.1, Steps: math.MaxInt32, Cap: 30 * time.Second}
	return wait.ExponentialBackoffWithContext(ctx, backoff, func(ctx context.Context) (bool, error) {
		_, err := kube.Discovery().ServerVersion()
		if err != nil {
			klog.FromContext(ctx).Error(err, "API server not reachable, retrying")
			p.health.setNotReady(fmt.Sprintf("API server not reachable: %v", err))
			return false, nil
		}
		return true, nil
	})
}

// restConfig builds the client configuration from --kubeconfig, else in-cluster.
func (o *Options) restConfig() (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if o.Kubeconfig != "" || o.Master != "" {
		cfg, err = clientcmd.BuildConfigFromFlags(o.Master, o.Kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("loading --kubeconfig %q / --master %q: %w", o.Kubeconfig, o.Master, err)
		}
	} else {
		cfg, err = rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("no --kubeconfig, --master or KUBECONFIG given and not running in a cluster: %w", err)
		}
	}
	cfg.QPS = float32(o.KubeAPIQPS)
	cfg.Burst = o.KubeAPIBurst
	cfg.UserAgent = "csi-sidecars"
	return cfg, nil
}

// withProtobuf is a copy of cfg that speaks protobuf, as upstream's sidecars do for
// built-in types: less CPU in the API server and here. Clients of custom resources (which
// have no protobuf form) use cfg itself.
func withProtobuf(cfg *rest.Config) *rest.Config {
	pb := rest.CopyConfig(cfg)
	pb.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	pb.ContentType = runtime.ContentTypeProtobuf
	return pb
}

// leaderElectionConfig is a copy of cfg for a dedicated clientset, so a busy sidecar's
// throttled client never delays renewing the Lease; its timeout keeps a hung request from
// outliving the renew deadline.
func (o *Options) leaderElectionConfig(cfg *rest.Config) *rest.Config {
	le := withProtobuf(cfg)
	le.Timeout = max(o.RenewDeadline/2, time.Second)
	return le
}

var errReturnedEarly = errors.New("sidecar stopped before it was asked to")

// probeTimeout bounds each driver probe at start: the longest --timeout of the hosted
// sidecars, as upstream bounds its probe by --timeout, else defaultProbeTimeout.
func probeTimeout(sidecars []Sidecar) time.Duration {
	var longest time.Duration
	for _, s := range sidecars {
		if t, ok := s.(CallTimeout); ok {
			longest = max(longest, t.CallTimeout())
		}
	}
	if longest <= 0 {
		return defaultProbeTimeout
	}
	return longest
}

// splitHosted sorts the hosted sidecars into those that lead and those that serve.
func splitHosted(hosted []Hosted) (leaders []Sidecar, servers []Server) {
	for _, h := range hosted {
		switch s := h.(type) {
		case Sidecar:
			leaders = append(leaders, s)
		case Server:
			servers = append(servers, s)
		default:
			// A programming error: every hosted sidecar is one kind or the other.
			panic(fmt.Sprintf("sidecar %s neither leads (Sidecar) nor serves (Server)", h.Name()))
		}
	}
	return leaders, servers
}

// newCSIMetrics is the CSI call metrics of a driver, with upstream's "migrated" label for a
// driver that replaced an in-tree plugin.
func newCSIMetrics(driver string) metrics.CSIMetricsManager {
	if csitrans.New().IsMigratedCSIDriverByName(driver) {
		return metrics.NewCSIMetricsManagerWithOptions(driver, metrics.WithMigration())
	}
	return metrics.NewCSIMetricsManagerWithOptions(driver)
}
