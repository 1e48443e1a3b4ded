// Package attacher is the csi-sidecars attacher, the drop-in for upstream external-attacher
// v4.13, hosted by the lifecycle core. It owns the VolumeAttachments of one CSI driver:
// it publishes and unpublishes their volumes (ControllerPublishVolume and
// ControllerUnpublishVolume), keeps the finalizers that make Kubernetes wait for that on
// VolumeAttachments and PersistentVolumes, records the outcome in their status, and
// reconciles them with the driver's ListVolumes. Flags, defaults, finalizer, annotation,
// Lease and queue names are upstream's (P9), plus two flags and a queue of its own for the
// split of attach and detach work below.
//
// Every CSI call and the API writes that record its result run on the core's Ops()
// context, never on intake (P1): a SIGTERM lets them finish and be recorded.
//
// It never handles signals, Leases or process exit, and keeps no package-level state.
//
// A detach removes the finalizer before it writes the status, as upstream, so a crash
// between the two writes never repeats ControllerUnpublishVolume.
//
// No publication outlives its VolumeAttachment, even after SIGKILL: the finalizer goes on
// the VolumeAttachment (with the node's ID, for a detach after the CSINode is gone) in
// the write before ControllerPublishVolume, so a VolumeAttachment deleted while its
// publish is uncertain (the leader killed mid-call, the driver finishing the call on its
// own) stays until whoever leads next has unpublished it, and only that removes the
// finalizer. The lifecycle core's Lease rules (P10, P11) keep the next leader's
// ControllerUnpublishVolume from overlapping the dead leader's publish. The provisioner's
// counterpart is its provisioning record; both are exercised by the chaos tests in
// test/e2e (SIGKILL of the leader mid-call, objects deleted during the failover).
//
// Attach and detach work have a queue and workers each, so a burst of slow or failing
// detaches (a node drained) no longer keeps attaches waiting behind it (upstream's issue
// 761: one queue, one pool of --worker-threads workers). The flags keep every upstream
// manifest's meaning: --worker-threads=N still bounds the VolumeAttachments attached or
// detached at once to N, so a driver sized for upstream never sees more calls at once, and
// one kind alone still gets all N, so neither an attach-only nor a detach-only burst runs
// slower than upstream. New --attach-worker-threads and --detach-worker-threads size each
// queue's workers; 0 (the default) is N. A slot freed by either kind goes to the worker
// that has waited longest, whatever its kind, so by default an attach that comes during a
// detach burst waits for the first running detach to end, not for the burst; setting
// --detach-worker-threads below N keeps the rest of the slots for attaches, which then
// start at once. (Splitting N evenly instead would halve every single-kind burst, and
// adding N workers per kind would double the calls a driver sees.) The attach queue keeps
// upstream's workqueue name, csi-attacher-va; detaches are csi-attacher-va-detach.
//
// A VolumeAttachment is with one kind of worker at a time, so the driver never sees a
// publish and an unpublish of one volume and node overlap: one deleted while its publish
// runs goes to the detach queue, and a detach worker that takes it meanwhile is turned
// away; the attach worker hands it over once the publish is recorded (see workers.go).
//
// A standby queues only the VolumeAttachments that need work (not attached yet, or being
// deleted with our finalizer on them); a settled one's sync is a no-op, so a standby that
// takes over starts on fresh work at once, not behind a no-op sync of every
// VolumeAttachment in the cluster. As leader it queues them as upstream does: its periodic
// resync (--resync) still syncs every settled VolumeAttachment, and the reconciler checks
// them against the driver as its term starts.
//
// A sync reads VolumeAttachments and PVs through this controller's own writes
// (lifecycle.OwnWrites): one that comes before the informer shows the last write starts
// from the written object, so a stale copy never calls the driver or writes again.
//
// Where it differs from upstream, on purpose and invisibly to users of the API: every
// write is a strategic merge patch of only what changed (none when nothing did), and a
// detach whose finalizer removal deletes the VolumeAttachment skips the status write that
// could only fail with NotFound; see attacher/patch.
package attacher

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/spf13/pflag"
	"k8s.io/component-base/featuregate"
	csitrans "k8s.io/csi-translation-lib"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// MutableCSINodeAllocatableCount records the gRPC code of a failed attach in
// status.attachError.errorCode, as upstream's gate of the same name.
const MutableCSINodeAllocatableCount featuregate.Feature = "MutableCSINodeAllocatableCount"

// Sidecar is the attacher.
type Sidecar struct {
	opts options
	ctrl *Controller
}

// options are the attacher's own flags.
type options struct {
	timeout            time.Duration
	workerThreads      uint
	attachThreads      uint
	detachThreads      uint
	resync             time.Duration
	retryIntervalStart time.Duration
	retryIntervalMax   time.Duration
	maxEntries         int
	reconcileSync      time.Duration
	defaultFSType      string
}

// New returns the attacher sidecar.
func New() *Sidecar { return &Sidecar{} }

var (
	_ lifecycle.Sidecar       = &Sidecar{}
	_ lifecycle.FlagValidator = &Sidecar{}
	_ lifecycle.FeatureGated  = &Sidecar{}
)

// Name implements lifecycle.Sidecar.
func (*Sidecar) Name() string { return "attacher" }

// AddFlags implements lifecycle.Sidecar with upstream's flags and defaults.
func (s *Sidecar) AddFlags(fs *pflag.FlagSet) {
	o := &s.opts
	fs.DurationVar(&o.timeout, "timeout", 15*time.Second, "Timeout for waiting for attaching or detaching the volume.")
	fs.UintVar(&o.workerThreads, "worker-threads", 10, "Number of attacher worker threads: at most this many VolumeAttachments are attached or detached at once, both together.")
	fs.UintVar(&o.attachThreads, "attach-worker-threads", 0, "Number of workers that attach VolumeAttachments, from their own queue. 0 is --worker-threads.")
	fs.UintVar(&o.detachThreads, "detach-worker-threads", 0, "Number of workers that detach VolumeAttachments, from their own queue; below --worker-threads, the remaining slots stay free for attaches during a detach burst. 0 is --worker-threads.")
	fs.DurationVar(&o.resync, "resync", 10*time.Minute, "Resync interval of the controller.")
	fs.DurationVar(&o.retryIntervalStart, "retry-interval-start", time.Second, "Initial retry interval of failed create volume or deletion. It doubles with each failure, up to retry-interval-max.")
	fs.DurationVar(&o.retryIntervalMax, "retry-interval-max", 5*time.Minute, "Maximum retry interval of failed create volume or deletion.")
	fs.IntVar(&o.maxEntries, "max-entries", 0, "Max entries per each page in volume lister call, 0 means no limit.")
	fs.DurationVar(&o.reconcileSync, "reconcile-sync", time.Minute, "Resync interval of the VolumeAttachment reconciler.")
	fs.StringVar(&o.defaultFSType, "default-fstype", "", "The default filesystem type of the volume to publish. Defaults to empty string")
}

// ValidateFlags implements lifecycle.FlagValidator.
func (s *Sidecar) ValidateFlags() error {
	o := s.opts
	if o.workerThreads == 0 {
		return errors.New("--worker-threads must be greater than zero")
	}
	if o.attachThreads > o.workerThreads {
		lifecycle.WarnFlag("attach-worker-threads", o.attachThreads, fmt.Sprintf("at most --worker-threads (%d) attach at once", o.workerThreads))
	}
	if o.detachThreads > o.workerThreads {
		lifecycle.WarnFlag("detach-worker-threads", o.detachThreads, fmt.Sprintf("at most --worker-threads (%d) detach at once", o.workerThreads))
	}
	if o.timeout <= 0 {
		lifecycle.WarnFlag("timeout", o.timeout, "every CSI call times out at once")
	}
	if o.retryIntervalStart <= 0 {
		lifecycle.WarnFlag("retry-interval-start", o.retryIntervalStart, "failed operations are retried without delay")
	}
	if o.retryIntervalMax < o.retryIntervalStart {
		lifecycle.WarnFlag("retry-interval-max", o.retryIntervalMax, "retries wait at most this long, less than --retry-interval-start")
	}
	if o.maxEntries < 0 {
		lifecycle.WarnFlag("max-entries", o.maxEntries, "passed to ListVolumes as it is; the driver may refuse it")
	}
	if o.reconcileSync <= 0 {
		lifecycle.WarnFlag("reconcile-sync", o.reconcileSync, "the ListVolumes reconciler is off (upstream would list without pause)")
	}
	if o.resync < 0 {
		lifecycle.WarnFlag("resync", o.resync, "treated as the informers' default resync")
	}
	return nil
}

// Features implements lifecycle.FeatureGated.
func (*Sidecar) Features() map[featuregate.Feature]featuregate.FeatureSpec {
	return map[featuregate.Feature]featuregate.FeatureSpec{
		MutableCSINodeAllocatableCount: {Default: true, PreRelease: featuregate.GA},
	}
}

// LeaseName implements lifecycle.Sidecar with upstream's Lease name; the core sanitises it.
func (*Sidecar) LeaseName(driver string) string { return "external-attacher-leader-" + driver }

// CallTimeout implements lifecycle.CallTimeout: --timeout also bounds each driver probe.
func (s *Sidecar) CallTimeout() time.Duration { return s.opts.timeout }

// Setup implements lifecycle.Sidecar: it picks the handler from the driver's capabilities
// and registers the controller's informers, on every replica.
func (s *Sidecar) Setup(env *lifecycle.Env) error {
	cfg := s.config(env)
	logger := klog.FromContext(env.Ops())
	switch {
	case cfg.trivial:
		logger.Info("CSI driver cannot publish volumes: marking every VolumeAttachment attached (trivial handler)", "driver", env.DriverName)
	case cfg.reconcile:
		logger.Info("CSI driver lists published nodes: reconciling VolumeAttachments with it", "driver", env.DriverName, "reconcileSync", cfg.reconcileSync)
	}
	// No event recorder: upstream's attacher records no Events (see patch.Writer.Failure).
	ctrl, err := newController(cfg, env.Kube, env.Informers, env.CSI, csitrans.New(), env.Ops())
	if err != nil {
		return err
	}
	s.ctrl = ctrl
	return nil
}

// config is the controller's configuration from the flags and the driver's capabilities.
func (s *Sidecar) config(env *lifecycle.Env) config {
	caps := env.ControllerCapabilities
	publish := env.PluginCapabilities[csi.PluginCapability_Service_CONTROLLER_SERVICE] &&
		caps[csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME]
	return config{
		driver:                env.DriverName,
		timeout:               s.opts.timeout,
		workers:               int(s.opts.workerThreads),
		attachWorkers:         int(s.opts.attachThreads),
		detachWorkers:         int(s.opts.detachThreads),
		backlog:               env.Backlog,
		resync:                s.opts.resync,
		retryIntervalStart:    s.opts.retryIntervalStart,
		retryIntervalMax:      s.opts.retryIntervalMax,
		maxEntries:            s.opts.maxEntries,
		reconcileSync:         s.opts.reconcileSync,
		defaultFSType:         s.opts.defaultFSType,
		trivial:               !publish,
		publishReadOnly:       caps[csi.ControllerServiceCapability_RPC_PUBLISH_READONLY],
		singleNodeMultiWriter: caps[csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER],
		reconcile: s.opts.reconcileSync > 0 && caps[csi.ControllerServiceCapability_RPC_LIST_VOLUMES] &&
			caps[csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES],
		errorCodes: env.Gates != nil && env.Gates.Enabled(MutableCSINodeAllocatableCount),
	}
}

// Run implements lifecycle.Sidecar: it works while this replica leads and returns once
// intake ended and every in-flight operation was recorded.
func (s *Sidecar) Run(intake context.Context, _ *lifecycle.Env) error {
	s.ctrl.run(intake)
	return nil
}
