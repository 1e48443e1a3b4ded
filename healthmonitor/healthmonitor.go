package healthmonitor

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/spf13/pflag"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Name is the subcommand.
const Name = "health-monitor"

// queueName is upstream's name of the queue of volumes to check one by one.
const queueName = "csi-monitor-pv-queue"

// Sidecar is the health monitor.
type Sidecar struct {
	monitorInterval       time.Duration
	listVolumesInterval   time.Duration
	volumeListAddInterval time.Duration
	nodeListAddInterval   time.Duration
	workerThreads         uint
	enableNodeWatcher     bool
	timeout               time.Duration
	resync                time.Duration

	// listMode is true for a driver with LIST_VOLUME_HEALTH.
	listMode bool
	poller   *poller
	reporter *reporter
	// queue holds the names of the PersistentVolumes to check one by one (no listMode).
	queue *lifecycle.Queue[string]
	nodes *nodeWatcher
	// queueMetrics is where the queue reports; nil is client-go's process-wide provider.
	queueMetrics workqueue.MetricsProvider
}

// New returns the health monitor with upstream's defaults.
func New() *Sidecar {
	return &Sidecar{
		monitorInterval:       time.Minute,
		listVolumesInterval:   5 * time.Minute,
		volumeListAddInterval: 5 * time.Minute,
		nodeListAddInterval:   5 * time.Minute,
		workerThreads:         10,
		timeout:               15 * time.Second,
		resync:                10 * time.Minute,
	}
}

var (
	_ lifecycle.Sidecar       = &Sidecar{}
	_ lifecycle.CallTimeout   = &Sidecar{}
	_ lifecycle.FlagValidator = &Sidecar{}
)

// Name implements lifecycle.Sidecar.
func (*Sidecar) Name() string { return Name }

// AddFlags implements lifecycle.Sidecar with upstream's names and defaults.
func (s *Sidecar) AddFlags(fs *pflag.FlagSet) {
	fs.DurationVar(&s.monitorInterval, "monitor-interval", s.monitorInterval, "Interval for controller to check volumes health condition: with a driver that lacks LIST_VOLUME_HEALTH, each bound volume gets a ControllerGetVolumeHealth call per interval.")
	fs.DurationVar(&s.listVolumesInterval, "list-volumes-interval", s.listVolumesInterval, "Time interval for calling ControllerListVolumeHealth (all pages) to check volumes' health condition, with a driver that has LIST_VOLUME_HEALTH.")
	fs.DurationVar(&s.volumeListAddInterval, "volume-list-add-interval", s.volumeListAddInterval, "Time interval for listing volumes and add them to queue. Accepted for compatibility and without effect: each --monitor-interval takes the volumes from the informer's cache, which has new volumes at once.")
	fs.DurationVar(&s.nodeListAddInterval, "node-list-add-interval", s.nodeListAddInterval, "Time interval for listing nodes and add them to queue (with --enable-node-watcher).")
	fs.UintVar(&s.workerThreads, "worker-threads", s.workerThreads, "Number of pv monitor worker threads.")
	fs.BoolVar(&s.enableNodeWatcher, "enable-node-watcher", s.enableNodeWatcher, "Indicates whether the node watcher is enabled or not.")
	fs.DurationVar(&s.timeout, "timeout", s.timeout, "Timeout of each ControllerGetVolumeHealth and ControllerListVolumeHealth call, and of the driver probes at start.")
	fs.DurationVar(&s.resync, "resync", s.resync, "Resync interval of the controller. Accepted for compatibility and without effect: the volumes are polled every interval anyway.")
}

// ValidateFlags implements lifecycle.FlagValidator. Upstream refuses --worker-threads=0.
func (s *Sidecar) ValidateFlags() error {
	if s.workerThreads == 0 {
		return fmt.Errorf("option --worker-threads must be greater than zero")
	}
	if s.timeout <= 0 {
		lifecycle.WarnFlag("timeout", s.timeout, "every CSI call times out at once")
	}
	if s.monitorInterval <= 0 {
		lifecycle.WarnFlag("monitor-interval", s.monitorInterval, "treated as one second")
	}
	if s.listVolumesInterval <= 0 {
		lifecycle.WarnFlag("list-volumes-interval", s.listVolumesInterval, "treated as one second")
	}
	return nil
}

// LeaseName implements lifecycle.Sidecar with upstream's Lease name.
func (*Sidecar) LeaseName(driver string) string { return "external-health-monitor-leader-" + driver }

// CallTimeout implements lifecycle.CallTimeout.
func (s *Sidecar) CallTimeout() time.Duration { return s.timeout }

// Setup implements lifecycle.Sidecar: it picks how to ask the driver, and registers the
// PersistentVolume and PersistentVolumeClaim informers (and, with the node watcher, the
// Node informer and a Pod informer of its own) on every replica (P7). A driver without the
// Controller service, or with neither health capability, ends the process with exit code
// 1, as upstream.
func (s *Sidecar) Setup(env *lifecycle.Env) error {
	logger := klog.FromContext(env.Ops()).WithValues("sidecar", s.Name(), "driver", env.DriverName)
	if !env.PluginCapabilities[csi.PluginCapability_Service_CONTROLLER_SERVICE] {
		return fmt.Errorf("CSI driver %s does not provide the CONTROLLER_SERVICE plugin capability: the health monitor has nothing to ask", env.DriverName)
	}
	switch {
	case env.ControllerCapabilities[csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH]:
		s.listMode = true
	case env.ControllerCapabilities[csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH]:
	default:
		return fmt.Errorf("CSI driver %s has neither the LIST_VOLUME_HEALTH nor the GET_VOLUME_HEALTH controller capability (CSI spec v1.13 and later): the health monitor has nothing to ask", env.DriverName)
	}

	pvInformer := env.Informers.Core().V1().PersistentVolumes()
	pvInformer.Informer() // registers it with the factory
	claimInformer := env.Informers.Core().V1().PersistentVolumeClaims().Informer()
	recorder := env.Events.NewRecorder(scheme.Scheme, v1.EventSource{Component: "csi-pv-monitor-controller-" + env.DriverName})
	s.reporter = newReporter(env.Kube, recorder)
	claims, err := lifecycle.NewOwnWrites[*v1.PersistentVolumeClaim](logger, claimInformer, cache.ResourceEventHandlerFuncs{
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if claim, ok := obj.(*v1.PersistentVolumeClaim); ok {
				s.reporter.forget(claim.UID)
			}
		},
	})
	if err != nil {
		return fmt.Errorf("watching PersistentVolumeClaims: %w", err)
	}
	s.reporter.claims = claims
	s.poller = &poller{
		driver:   env.DriverName,
		client:   csi.NewControllerClient(env.CSI),
		pvs:      pvInformer.Lister(),
		reporter: s.reporter,
		timeout:  s.timeout,
		ops:      env.Ops,
	}
	if s.listMode {
		logger.Info("Volume health by ControllerListVolumeHealth", "interval", s.listVolumesInterval)
	} else {
		logger.Info("Volume health by ControllerGetVolumeHealth per volume", "interval", s.monitorInterval, "workers", s.workerThreads)
		s.queue = lifecycle.NewQueue[string](lifecycle.QueueOptions{Name: queueName, RetryStart: time.Second, RetryMax: s.monitorInterval,
			Metrics: s.queueMetrics, Backlog: env.Backlog})
	}
	if s.enableNodeWatcher {
		if s.nodes, err = newNodeWatcher(env, recorder, s.poller, s.nodeListAddInterval, s.queueMetrics); err != nil {
			return err
		}
	}
	return nil
}

// Run implements lifecycle.Sidecar: the passes run until intake ends; a call in the driver
// then finishes on Ops() and its answer is recorded (P1).
func (s *Sidecar) Run(intake context.Context, _ *lifecycle.Env) error {
	s.reporter.startTerm()
	var wg sync.WaitGroup
	if s.nodes != nil {
		wg.Go(func() { s.nodes.run(intake) })
	}
	if s.listMode {
		wg.Go(func() { every(intake, s.listVolumesInterval, func() { s.poller.listPass(intake) }) })
		wg.Wait()
		return nil
	}
	wg.Go(func() {
		every(intake, s.monitorInterval, func() {
			for _, pv := range s.poller.boundVolumes() {
				s.queue.Add(pv.Name)
			}
		})
	})
	lifecycle.RunWorkers(intake, s.queue, int(s.workerThreads), s.poller.checkVolume)
	wg.Wait()
	return nil
}
