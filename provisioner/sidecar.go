package provisioner

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"github.com/spf13/pflag"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/component-base/featuregate"
	"k8s.io/klog/v2"
	gatewayclientset "sigs.k8s.io/gateway-api/pkg/client/clientset/versioned"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/capacity"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
	"github.com/csi-sidecars/csi-sidecars/provisioner/sources"
)

// Sidecar is the provisioner, as the lifecycle core hosts it.
type Sidecar struct {
	opts   options
	getenv func(string) string
	// discoveryBackoff paces the retries of the VolumeAttributesClass discovery at start.
	discoveryBackoff wait.Backoff
	ctrl             *claimController
	// capacity is set with --enable-capacity.
	capacity *capacity.Tracker
}

// New returns the provisioner sidecar.
func New() *Sidecar {
	return &Sidecar{getenv: os.Getenv, discoveryBackoff: lifecycle.DiscoveryBackoff()}
}

var (
	_ lifecycle.Sidecar       = &Sidecar{}
	_ lifecycle.FeatureGated  = &Sidecar{}
	_ lifecycle.FlagValidator = &Sidecar{}
	_ lifecycle.CallTimeout   = &Sidecar{}
)

// CallTimeout implements lifecycle.CallTimeout: --timeout also bounds each driver probe.
func (s *Sidecar) CallTimeout() time.Duration { return s.opts.timeout }

// Name implements lifecycle.Sidecar.
func (*Sidecar) Name() string { return "provisioner" }

// AddFlags implements lifecycle.Sidecar.
func (s *Sidecar) AddFlags(fs *pflag.FlagSet) { s.opts.addFlags(fs) }

// Features implements lifecycle.FeatureGated.
func (*Sidecar) Features() map[featuregate.Feature]featuregate.FeatureSpec { return features() }

// ValidateFlags implements lifecycle.FlagValidator.
func (s *Sidecar) ValidateFlags() error { return s.opts.validate(s.getenv) }

// LeaseName implements lifecycle.Sidecar: upstream's provisioner Lease is named after the
// driver (the core sanitises it as upstream does, P9).
func (*Sidecar) LeaseName(driver string) string { return driver }

// Setup implements lifecycle.Sidecar: it builds the controller on every replica, so a
// standby's caches and queues are warm when it takes over (P7).
func (s *Sidecar) Setup(env *lifecycle.Env) error {
	logger := klog.Background().WithValues("sidecar", s.Name())
	m, err := newControllerMetrics(env.Metrics.GetRegistry())
	if err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	// Upstream's per-instance identity, recorded in every volume's attributes.
	identity := strconv.FormatInt(time.Now().UnixMilli(), 10) + "-" + strconv.Itoa(rand.IntN(10000)) + "-" + env.DriverName
	source := v1.EventSource{Component: env.DriverName + "_" + env.Identity}
	cfg := config{
		opts:           s.opts,
		driver:         env.DriverName,
		inTree:         request.NamesOf(env.DriverName).InTree,
		identity:       identity,
		kube:           env.Kube,
		csi:            csi.NewControllerClient(env.CSI),
		ops:            env.Ops(),
		recorder:       env.Events.NewRecorder(scheme.Scheme, source),
		eventSource:    source,
		metrics:        m,
		pluginCaps:     env.PluginCapabilities,
		controllerCaps: env.ControllerCapabilities,
		topology:       env.PluginCapabilities[csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS] && env.Gates.Enabled(Topology),
		backlog:        env.Backlog,
		vac:            volumeAttributesClassEnabled(env.Ops(), env.Gates, env.Kube.Discovery(), s.discoveryBackoff),
	}
	if s.opts.nodeDeployment {
		if cfg.node, err = newLocalNode(env.Ops(), s.opts, csi.NewNodeClient(env.CSI)); err != nil {
			return err
		}
		cfg.identity += "-" + s.opts.nodeName
	}
	if cfg.inTree != "" {
		logger.Info("Supports migration from in-tree plugin", "plugin", cfg.inTree)
	}
	if err := request.CheckCapabilities(env.PluginCapabilities, env.ControllerCapabilities, false); err != nil {
		// Upstream starts anyway and reports it on every claim; so do we.
		logger.Error(err, "The driver cannot provision volumes; claims will get events saying so")
	}
	if cfg.snapshotClient, err = snapshotClientFor(env); err != nil {
		return err
	}
	if env.Gates.Enabled(CrossNamespaceVolumeDataSource) {
		// Whether the cluster serves ReferenceGrants, and lets us read them, is the
		// grants' watch's to find out and to log; nothing waits for it.
		if cfg.grantClient, err = gatewayclientset.NewForConfig(env.RestConfig); err != nil {
			return fmt.Errorf("creating the ReferenceGrant client: %w", err)
		}
	}
	if s.ctrl, err = newController(cfg, env.Informers); err != nil {
		return err
	}
	// The informers of the records and snapshots are not on the core's factory: they
	// start here, on every replica (P7), and stop with the process.
	s.ctrl.startInformers(env.Done())
	if s.opts.enableCapacity {
		if s.capacity, err = newCapacityFor(env, s.opts, cfg.node); err != nil {
			return err
		}
		// Like the snapshot informer, the informer of the capacity objects is its own.
		s.capacity.Start(env.Done())
		// Before Run: a provisioning or deletion refreshes the capacity it changed.
		s.ctrl.capacity = s.capacity
	}
	return nil
}

// newCapacityFor builds capacity tracking from the Env: its own rate-limited client, the
// owner the flags ask for, and in a node deployment the node's one segment.
func newCapacityFor(env *lifecycle.Env, opts options, node *localNode) (*capacity.Tracker, error) {
	if !env.ControllerCapabilities[csi.ControllerServiceCapability_RPC_GET_CAPACITY] {
		return nil, lifecycle.UsageError{Err: errors.New("--enable-capacity: the driver does not report the GET_CAPACITY controller capability")}
	}
	rc := rest.CopyConfig(env.RestConfig)
	rc.QPS, rc.Burst = opts.kubeAPICapacityQPS, opts.kubeAPICapacityBurst
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("creating the client for storage capacity: %w", err)
	}
	cfg := capacity.Config{
		Driver:       env.DriverName,
		Namespace:    opts.capacityNamespace,
		ManagedBy:    capacity.ManagedByFor(""),
		Immediate:    opts.capacityForImmediateBinding,
		PollInterval: opts.capacityPollInterval,
		Timeout:      opts.timeout,
		Threads:      int(opts.capacityThreads),
		CSI:          csi.NewControllerClient(env.CSI),
		Kube:         client,
		Ops:          env.Ops(),
		Backlog:      env.Backlog,
	}
	if node != nil {
		cfg.ManagedBy = capacity.ManagedByFor(node.name)
		// Not nil even for a driver without topology: the node's one (empty) segment.
		cfg.NodeSegment = maps.Clone(node.info.GetAccessibleTopology().GetSegments())
		if cfg.NodeSegment == nil {
			cfg.NodeSegment = map[string]string{}
		}
	}
	if opts.capacityOwnerrefLevel >= 0 {
		ctx, cancel := context.WithTimeout(env.Ops(), opts.timeout)
		defer cancel()
		owners, err := capacity.NewOwnerReader(env.RestConfig, env.Kube.Discovery())
		if err != nil {
			return nil, err
		}
		if cfg.Owner, err = capacity.LookupOwner(ctx, env.Kube, owners, opts.capacityNamespace, opts.podName, opts.capacityOwnerrefLevel); err != nil {
			return nil, err
		}
	}
	t, err := capacity.New(cfg, env.Informers, opts.retryIntervalStart, opts.retryIntervalMax)
	if err != nil {
		return nil, err
	}
	if err := env.Metrics.GetRegistry().CustomRegister(capacity.NewCollector(t)); err != nil {
		return nil, fmt.Errorf("registering the storage capacity metrics: %w", err)
	}
	return t, nil
}

// snapshotClientFor returns a VolumeSnapshot client when the driver restores snapshots
// and the cluster serves the API; nil otherwise: claims restoring a snapshot then get an
// event saying why.
func snapshotClientFor(env *lifecycle.Env) (snapclientset.Interface, error) {
	logger := klog.Background().WithValues("sidecar", "provisioner")
	if !env.ControllerCapabilities[csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT] {
		return nil, nil
	}
	served, err := sources.SnapshotAPIAvailable(env.Kube.Discovery())
	if err != nil {
		return nil, err
	}
	if !served {
		logger.Info("The driver can restore snapshots but the cluster does not serve the VolumeSnapshot API; restoring is off")
		return nil, nil
	}
	client, err := snapclientset.NewForConfig(env.RestConfig)
	if err != nil {
		return nil, fmt.Errorf("creating the VolumeSnapshot client: %w", err)
	}
	return client, nil
}

// Run implements lifecycle.Sidecar: it works the claim and volume queues until intake
// ends and every operation in flight has finished on Ops() (P1).
func (s *Sidecar) Run(intake context.Context, _ *lifecycle.Env) error {
	var wg sync.WaitGroup
	if s.capacity != nil {
		wg.Go(func() { s.capacity.Run(intake) })
	}
	s.ctrl.run(intake)
	wg.Wait()
	return nil
}
