package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotscheme "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/scheme"
	"github.com/spf13/pflag"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/component-base/featuregate"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// VolumeGroupSnapshot is upstream's gate for volume group snapshots (GA, on by default).
const VolumeGroupSnapshot featuregate.Feature = "CSIVolumeGroupSnapshot"

// nodeNameEnv names the node a --node-deployment snapshotter serves, as upstream.
const nodeNameEnv = "NODE_NAME"

// Sidecar is the snapshotter.
type Sidecar struct {
	opts options
	// nodeName is $NODE_NAME, read once when the flags are checked (--node-deployment).
	nodeName string

	contents *contentController
	groups   *groupController
}

// options are the snapshotter's own flags, with upstream's names and defaults.
type options struct {
	resync                 time.Duration
	snapshotNamePrefix     string
	snapshotNameUUIDLength int
	workerThreads          int
	timeout                time.Duration
	extraCreateMetadata    bool
	retryIntervalStart     time.Duration
	retryIntervalMax       time.Duration
	nodeDeployment         bool
	groupNamePrefix        string
	groupNameUUIDLength    int
}

// New returns the snapshotter sidecar.
func New() *Sidecar { return &Sidecar{} }

var (
	_ lifecycle.Sidecar             = &Sidecar{}
	_ lifecycle.FlagValidator       = &Sidecar{}
	_ lifecycle.SharedFlagValidator = &Sidecar{}
	_ lifecycle.FeatureGated        = &Sidecar{}
	_ lifecycle.CallTimeout         = &Sidecar{}
)

// Name implements lifecycle.Sidecar.
func (*Sidecar) Name() string { return "snapshotter" }

// AddFlags implements lifecycle.Sidecar with csi-snapshotter v8.7's flags and defaults.
func (s *Sidecar) AddFlags(fs *pflag.FlagSet) {
	o := &s.opts
	fs.DurationVar(&o.resync, "resync-period", 15*time.Minute, "Resync interval of the controller.")
	fs.StringVar(&o.snapshotNamePrefix, "snapshot-name-prefix", "snapshot", "Prefix to apply to the name of a created snapshot.")
	fs.IntVar(&o.snapshotNameUUIDLength, "snapshot-name-uuid-length", -1, "Length in characters for the generated uuid of a created snapshot. The default, -1, does not truncate.")
	fs.IntVar(&o.workerThreads, "worker-threads", 10, "Number of worker threads.")
	fs.DurationVar(&o.timeout, "timeout", time.Minute, "The timeout for any RPCs to the CSI driver.")
	fs.BoolVar(&o.extraCreateMetadata, "extra-create-metadata", false, "If set, add snapshot metadata to plugin snapshot requests as parameters.")
	fs.DurationVar(&o.retryIntervalStart, "retry-interval-start", time.Second, "Initial retry interval of failed volume snapshot creation or deletion. It doubles with each failure, up to retry-interval-max.")
	fs.DurationVar(&o.retryIntervalMax, "retry-interval-max", 5*time.Minute, "Maximum retry interval of failed volume snapshot creation or deletion.")
	fs.BoolVar(&o.nodeDeployment, "node-deployment", false, "Enables deploying the sidecar controller together with a CSI driver on nodes to manage snapshots for node-local volumes ($NODE_NAME names the node).")
	fs.StringVar(&o.groupNamePrefix, "groupsnapshot-name-prefix", "groupsnapshot", "Prefix to apply to the name of a created group snapshot.")
	fs.IntVar(&o.groupNameUUIDLength, "groupsnapshot-name-uuid-length", -1, "Length in characters for the generated uuid of a created group snapshot. The default, -1, does not truncate.")
}

// ValidateFlags implements lifecycle.FlagValidator: it refuses what upstream refuses at
// start (an empty snapshot name prefix, --node-deployment without $NODE_NAME) and warns of
// values upstream accepts. An empty group snapshot prefix is refused in Setup, only where
// group snapshots are on, as upstream.
func (s *Sidecar) ValidateFlags() error {
	o := s.opts
	if o.snapshotNamePrefix == "" {
		return errors.New("--snapshot-name-prefix must not be empty")
	}
	if o.nodeDeployment {
		s.nodeName = os.Getenv(nodeNameEnv)
		if s.nodeName == "" {
			return fmt.Errorf("--node-deployment needs the %s environment variable to name this node", nodeNameEnv)
		}
	}
	if o.workerThreads <= 0 {
		lifecycle.WarnFlag("worker-threads", o.workerThreads, "no worker runs: nothing is snapshotted")
	}
	if o.timeout <= 0 {
		lifecycle.WarnFlag("timeout", o.timeout, "every CSI call times out at once")
	}
	for flag, n := range map[string]int{"snapshot-name-uuid-length": o.snapshotNameUUIDLength, "groupsnapshot-name-uuid-length": o.groupNameUUIDLength} {
		if n < -1 || n == 0 || n > 32 {
			lifecycle.WarnFlag(flag, n, "names keep the whole UID where it has fewer characters (upstream would crash)")
		}
	}
	if o.retryIntervalMax < o.retryIntervalStart {
		lifecycle.WarnFlag("retry-interval-max", o.retryIntervalMax, "retries wait at most this long, less than --retry-interval-start")
	}
	return nil
}

// ValidateSharedFlags implements lifecycle.SharedFlagValidator: upstream refuses leader
// election on a node deployment, where every node runs its own snapshotter.
func (s *Sidecar) ValidateSharedFlags(shared *lifecycle.Options) error {
	if s.opts.nodeDeployment && shared.LeaderElection {
		return errors.New("--leader-election cannot be used with --node-deployment")
	}
	return nil
}

// Features implements lifecycle.FeatureGated.
func (*Sidecar) Features() map[featuregate.Feature]featuregate.FeatureSpec {
	return map[featuregate.Feature]featuregate.FeatureSpec{
		VolumeGroupSnapshot: {Default: true, PreRelease: featuregate.GA},
	}
}

// LeaseName implements lifecycle.Sidecar with upstream's Lease name; the core sanitises it.
func (*Sidecar) LeaseName(driver string) string { return "external-snapshotter-leader-" + driver }

// CallTimeout implements lifecycle.CallTimeout: --timeout also bounds each driver probe.
func (s *Sidecar) CallTimeout() time.Duration { return s.opts.timeout }

// Setup implements lifecycle.Sidecar: it checks the driver takes snapshots and registers the
// controllers' informers, on every replica (P7).
func (s *Sidecar) Setup(env *lifecycle.Env) error {
	logger := klog.FromContext(env.Ops())
	if !env.ControllerCapabilities[csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT] {
		return lifecycle.UsageError{Err: fmt.Errorf("CSI driver %s does not support ControllerCreateSnapshot", env.DriverName)}
	}
	sch := runtime.NewScheme()
	if err := snapshotscheme.AddToScheme(sch); err != nil {
		return fmt.Errorf("building the event scheme: %w", err)
	}
	recorder := env.Events.NewRecorder(sch, v1.EventSource{Component: "csi-snapshotter " + env.DriverName})
	client, err := newClients(env, s.opts.resync, s.nodeName)
	if err != nil {
		return err
	}
	cfg := controllerConfig{
		clients:      client,
		driver:       driverFor(env, s.opts),
		recorder:     recorder,
		resync:       s.opts.resync,
		retryStart:   s.opts.retryIntervalStart,
		retryMax:     s.opts.retryIntervalMax,
		backlog:      env.Backlog,
		extraCreate:  s.opts.extraCreateMetadata,
		namePrefix:   s.opts.snapshotNamePrefix,
		nameUUIDSize: s.opts.snapshotNameUUIDLength,
	}
	if s.contents, err = newContentController(cfg); err != nil {
		return err
	}
	if env.Gates.Enabled(VolumeGroupSnapshot) {
		if err := client.groupSnapshotsServed(env.Ops(), s.opts.timeout); err != nil {
			logger.Info("Warning: the VolumeGroupSnapshot CRDs were not found; volume group snapshots are off for this run. Install them to use group snapshots", "err", err)
		} else {
			if !groupSnapshotsSupported(env, s.opts.timeout) {
				logger.Info("Warning: the CSI driver does not support CreateVolumeGroupSnapshot; group snapshot contents of this driver will fail", "driver", env.DriverName)
			}
			if s.opts.groupNamePrefix == "" {
				// Refused only where group snapshots are on, as upstream.
				return lifecycle.UsageError{Err: errors.New("--groupsnapshot-name-prefix must not be empty")}
			}
			cfg.namePrefix, cfg.nameUUIDSize = s.opts.groupNamePrefix, s.opts.groupNameUUIDLength
			s.groups, err = newGroupController(cfg)
			if err != nil {
				return err
			}
		}
	}
	client.start(env.Done())
	return nil
}

// Run implements lifecycle.Sidecar: the workers run until intake ends and finish the item
// they hold on Ops() (P1).
func (s *Sidecar) Run(intake context.Context, env *lifecycle.Env) error {
	var wg sync.WaitGroup
	wg.Go(func() { s.contents.run(intake, env.Ops(), s.opts.workerThreads) })
	if s.groups != nil {
		wg.Go(func() { s.groups.run(intake, env.Ops(), s.opts.workerThreads) })
	}
	wg.Wait()
	return nil
}
