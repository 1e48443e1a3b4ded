package resizer

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/spf13/pflag"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/component-base/featuregate"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Feature gates, with upstream's names and maturity.
const (
	// AnnotateFsResize records a PV's capacity before a resize that needs node expansion in
	// the volume.alpha.kubernetes.io/pre-resize-capacity annotation.
	AnnotateFsResize featuregate.Feature = "AnnotateFsResize"
	// RecoverVolumeExpansionFailure was removed in upstream v2.3.0, where recovery (a user
	// may lower a request that failed; allocatedResources and allocatedResourceStatuses are
	// recorded) is always on. It is still accepted, deprecated and without effect, so that
	// manifests written for v2.2 keep working; upstream v2.3.0 refuses it.
	RecoverVolumeExpansionFailure featuregate.Feature = "RecoverVolumeExpansionFailure"
	// VolumeAttributesClass runs the modify controller.
	VolumeAttributesClass featuregate.Feature = "VolumeAttributesClass"
)

// Sidecar is the resizer.
type Sidecar struct {
	workers int
	// timeout bounds the driver probes at start; set on the command line, it is also the
	// timeout of every expand and modify call, in place of resizeTimeout and modifyTimeout.
	timeout             explicitDuration
	resizeTimeout       time.Duration
	modifyTimeout       time.Duration
	resync              time.Duration
	retryStart          time.Duration
	retryMax            time.Duration
	handleInUse         bool
	extraModifyMetadata bool

	// discoveryBackoff paces the retries of the VolumeAttributesClass discovery at start.
	discoveryBackoff wait.Backoff

	expansion    *expansionController
	modification *modifyController
	// queueMetrics is where the queues report; nil is client-go's process-wide provider.
	queueMetrics workqueue.MetricsProvider
}

// New returns the resizer sidecar.
func New() *Sidecar {
	return &Sidecar{
		workers:       10,
		timeout:       explicitDuration{value: 10 * time.Second},
		resizeTimeout: 10 * time.Second,
		modifyTimeout: 10 * time.Second,
		resync:        10 * time.Minute,
		retryStart:    time.Second,
		retryMax:      5 * time.Minute,
		handleInUse:   true,
		// About 15 s in all: enough for an API server that restarts, short enough for
		// a start-up.
		discoveryBackoff: lifecycle.DiscoveryBackoff(),
	}
}

var (
	_ lifecycle.Sidecar       = &Sidecar{}
	_ lifecycle.FeatureGated  = &Sidecar{}
	_ lifecycle.FlagValidator = &Sidecar{}
)

// Name implements lifecycle.Sidecar.
func (*Sidecar) Name() string { return "resizer" }

// AddFlags implements lifecycle.Sidecar with upstream's names and defaults.
func (s *Sidecar) AddFlags(fs *pflag.FlagSet) {
	fs.IntVar(&s.workers, "workers", s.workers, "Concurrency to process multiple resize requests.")
	fs.Var(&s.timeout, "timeout", "Timeout of the CSI driver probes at start. If set explicitly on the command line, also the timeout of every ControllerExpandVolume and ControllerModifyVolume call, in place of --resize-timeout and --modify-timeout.")
	fs.DurationVar(&s.resizeTimeout, "resize-timeout", s.resizeTimeout, "Timeout of each ControllerExpandVolume call. Ignored if --timeout is set explicitly on the command line.")
	fs.DurationVar(&s.modifyTimeout, "modify-timeout", s.modifyTimeout, "Timeout of each ControllerModifyVolume call. Ignored if --timeout is set explicitly on the command line.")
	fs.DurationVar(&s.resync, "resync-period", s.resync, "Resync period for cache.")
	fs.DurationVar(&s.retryStart, "retry-interval-start", s.retryStart, "Initial retry interval of failed volume resize. It exponentially increases with each failure, up to retry-interval-max.")
	fs.DurationVar(&s.retryMax, "retry-interval-max", s.retryMax, "Maximum retry interval of failed volume resize.")
	fs.BoolVar(&s.handleInUse, "handle-volume-inuse-error", s.handleInUse, "Flag to turn on/off capability to handle volume in use error in resizer controller. Defaults to true if not set.")
	fs.BoolVar(&s.extraModifyMetadata, "extra-modify-metadata", s.extraModifyMetadata, "If set, add pv/pvc metadata to plugin modify requests as parameters.")
}

// Features implements lifecycle.FeatureGated.
func (*Sidecar) Features() map[featuregate.Feature]featuregate.FeatureSpec {
	return map[featuregate.Feature]featuregate.FeatureSpec{
		AnnotateFsResize:              {Default: true, PreRelease: featuregate.Beta},
		RecoverVolumeExpansionFailure: {Default: true, PreRelease: featuregate.Deprecated},
		VolumeAttributesClass:         {Default: true, PreRelease: featuregate.GA},
	}
}

// ValidateFlags implements lifecycle.FlagValidator.
func (s *Sidecar) ValidateFlags() error {
	if s.workers <= 0 {
		lifecycle.WarnFlag("workers", s.workers, "no workers: nothing is resized or modified")
	}
	switch {
	case s.timeout.set && s.timeout.value <= 0:
		lifecycle.WarnFlag("timeout", s.timeout.value, "every CSI call times out at once")
	case s.timeout.value <= 0:
		lifecycle.WarnFlag("timeout", s.timeout.value, "every driver probe at start times out at once")
	}
	if !s.timeout.set && s.resizeTimeout <= 0 {
		lifecycle.WarnFlag("resize-timeout", s.resizeTimeout, "every ControllerExpandVolume call times out at once")
	}
	if !s.timeout.set && s.modifyTimeout <= 0 {
		lifecycle.WarnFlag("modify-timeout", s.modifyTimeout, "every ControllerModifyVolume call times out at once")
	}
	if s.resync < 0 {
		lifecycle.WarnFlag("resync-period", s.resync, "treated as the informers' default resync")
	}
	if s.retryStart <= 0 {
		lifecycle.WarnFlag("retry-interval-start", s.retryStart, "failed operations are retried without delay")
	}
	if s.retryMax < s.retryStart {
		lifecycle.WarnFlag("retry-interval-max", s.retryMax, "retries wait at most this long, less than --retry-interval-start")
	}
	return nil
}

// LeaseName implements lifecycle.Sidecar with upstream's Lease name.
func (*Sidecar) LeaseName(driver string) string { return "external-resizer-" + driver }

// CallTimeout implements lifecycle.CallTimeout: --timeout bounds each driver probe.
func (s *Sidecar) CallTimeout() time.Duration { return s.timeout.value }

// callTimeouts are the timeouts of each ControllerExpandVolume and ControllerModifyVolume
// call: --timeout for both when it was set on the command line, as upstream v2.3.0, else
// --resize-timeout and --modify-timeout.
func (s *Sidecar) callTimeouts() (expand, modify time.Duration) {
	if s.timeout.set {
		return s.timeout.value, s.timeout.value
	}
	return s.resizeTimeout, s.modifyTimeout
}

// Setup implements lifecycle.Sidecar: it decides from the driver's capabilities which
// controllers run, and registers their informers on every replica (P7).
func (s *Sidecar) Setup(env *lifecycle.Env) error {
	logger := klog.FromContext(env.Ops()).WithValues("sidecar", s.Name(), "driver", env.DriverName)
	caps, err := s.capabilities(env)
	if err != nil {
		return err
	}
	recorder := env.Events.NewRecorder(scheme.Scheme, v1.EventSource{Component: "external-resizer " + env.DriverName})
	// One writer for both controllers: each reads the PVCs and PVs through the other's
	// writes as well as its own.
	base, err := newWriter(env.Kube, env.Ops, recorder, env.DriverName, env.Informers)
	if err != nil {
		return err
	}
	expandTimeout, modifyTimeout := s.callTimeouts()
	shared := controllerConfig{queueMetrics: s.queueMetrics, backlog: env.Backlog, informers: env.Informers,
		resync: s.resync, retryStart: s.retryStart, retryMax: s.retryMax}

	expandQueue, modifyQueue := queueNames(env.DriverName, caps.expand != nil)
	if caps.expand != nil {
		logger.Info("Volume expansion enabled", "mode", caps.expand.mode(), "queue", expandQueue)
		s.expansion, err = newExpansionController(expansionConfig{
			controllerConfig: shared.forController(base.withCallTimeout(expandTimeout), expandQueue),
			expander:         caps.expand,
			handleInUse:      s.handleInUse,
			annotateFs:       env.Gates.Enabled(AnnotateFsResize),
		})
		if err != nil {
			return err
		}
	}
	if caps.modify != nil {
		logger.Info("Volume modification enabled", "queue", modifyQueue)
		s.modification, err = newModifyController(modifyConfig{
			controllerConfig: shared.forController(base.withCallTimeout(modifyTimeout), modifyQueue),
			modifier:         caps.modify,
			extraMetadata:    s.extraModifyMetadata,
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// queueNames are the names of the expansion and modification queues, which label
// client-go's workqueue metrics (workqueue_depth{name="..."}). Upstream names both
// "<driver>-pvc". Those metrics are per process and keyed by name alone, so two queues of
// one name would share their series: depth and adds summed, and the unfinished-work and
// longest-running-processor gauges overwritten by whichever queue reported last. The
// expansion queue keeps upstream's name; the modification queue has it too when it is the
// only one (a driver that modifies but cannot expand), and "<driver>-modify-pvc" beside an
// expansion queue.
func queueNames(driver string, expands bool) (expand, modify string) {
	expand, modify = driver+"-pvc", driver+"-pvc"
	if expands {
		modify = driver + "-modify-pvc"
	}
	return expand, modify
}

// driverCapabilities is what the resizer will do with this driver.
type driverCapabilities struct {
	expand expander  // nil: no expansion
	modify *modifier // nil: no modification
}

// capabilities picks the expander and modifier the driver supports, as upstream does: the
// controller service is required; controller EXPAND_VOLUME means CSI expansion, else node
// EXPAND_VOLUME means the trivial resizer; MODIFY_VOLUME (with the VolumeAttributesClass
// gate) means modification. A driver with neither is a configuration error (exit 2). The
// node probe runs on env.Ops() (P1).
func (s *Sidecar) capabilities(env *lifecycle.Env) (driverCapabilities, error) {
	var caps driverCapabilities
	if !env.PluginCapabilities[csi.PluginCapability_Service_CONTROLLER_SERVICE] {
		return caps, lifecycle.UsageError{Err: fmt.Errorf("CSI driver %s does not provide the CONTROLLER_SERVICE plugin capability the resizer needs", env.DriverName)}
	}
	ctrl := csi.NewControllerClient(env.CSI)
	switch {
	case env.ControllerCapabilities[csi.ControllerServiceCapability_RPC_EXPAND_VOLUME]:
		caps.expand = &csiExpander{
			client:            ctrl,
			kube:              env.Kube,
			singleNodeMultiWr: env.ControllerCapabilities[csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER],
		}
	default:
		node, err := nodeExpands(env, s.timeout.value)
		if err != nil {
			return caps, err
		}
		if node {
			caps.expand = trivialExpander{}
		}
	}
	if env.ControllerCapabilities[csi.ControllerServiceCapability_RPC_MODIFY_VOLUME] {
		if volumeAttributesClassEnabled(env.Ops(), env.Gates, env.Kube.Discovery(), s.discoveryBackoff) {
			caps.modify = &modifier{client: ctrl, kube: env.Kube}
		}
	}
	if caps.expand == nil && caps.modify == nil {
		return caps, lifecycle.UsageError{Err: fmt.Errorf("CSI driver %s supports neither volume expansion (controller or node EXPAND_VOLUME) nor volume modification (MODIFY_VOLUME with the VolumeAttributesClass feature gate): the resizer has nothing to do", env.DriverName)}
	}
	return caps, nil
}

// nodeExpands asks the driver's Node service whether it grows volumes on the node. The call
// runs on Ops() like every CSI call (P1).
func nodeExpands(env *lifecycle.Env, timeout time.Duration) (bool, error) {
	ctx, cancel := context.WithTimeout(env.Ops(), timeout)
	defer cancel()
	rsp, err := csi.NewNodeClient(env.CSI).NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
	if err != nil {
		return false, fmt.Errorf("asking CSI driver %s for its node capabilities: %w", env.DriverName, err)
	}
	return slices.ContainsFunc(rsp.GetCapabilities(), func(c *csi.NodeServiceCapability) bool {
		return c.GetRpc().GetType() == csi.NodeServiceCapability_RPC_EXPAND_VOLUME
	}), nil
}

// volumeAttributesClassEnabled applies the VolumeAttributesClass gate: off where the API
// server does not serve storage.k8s.io/v1 VolumeAttributesClass, unless set explicitly.
func volumeAttributesClassEnabled(ctx context.Context, gates featuregate.FeatureGate, disc discovery.DiscoveryInterface, backoff wait.Backoff) bool {
	return lifecycle.GateServed(ctx, gates, VolumeAttributesClass, disc, "storage.k8s.io/v1", "volumeattributesclasses", backoff)
}

// Run implements lifecycle.Sidecar: both controllers' workers run until intake ends and
// finish the item they hold on Ops() (P1).
func (s *Sidecar) Run(intake context.Context, _ *lifecycle.Env) error {
	var wg sync.WaitGroup
	if s.expansion != nil {
		wg.Go(func() { s.expansion.run(intake, s.workers) })
	}
	if s.modification != nil {
		wg.Go(func() { s.modification.run(intake, s.workers) })
	}
	wg.Wait()
	return nil
}

// explicitDuration is a duration flag that knows whether the command line set it. Its
// value is shared by the subcommand's flag and combined mode's prefixed one, so either
// spelling counts.
type explicitDuration struct {
	value time.Duration
	set   bool
}

var _ pflag.Value = &explicitDuration{}

func (d *explicitDuration) String() string { return d.value.String() }
func (d *explicitDuration) Type() string   { return "duration" }

func (d *explicitDuration) Set(v string) error {
	parsed, err := time.ParseDuration(v)
	if err != nil {
		return err
	}
	d.value, d.set = parsed, true
	return nil
}
