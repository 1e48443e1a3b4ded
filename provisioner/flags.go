package provisioner

import (
	"errors"
	"fmt"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/component-base/featuregate"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Feature gates of the provisioner, joined to the shared --feature-gates flag.
const (
	// Topology passes accessibility requirements to CreateVolume and node affinity to the
	// PersistentVolume when the driver reports VOLUME_ACCESSIBILITY_CONSTRAINTS.
	Topology featuregate.Feature = "Topology"
	// VolumeAttributesClass passes a claim's VolumeAttributesClass parameters to
	// CreateVolume as mutable parameters.
	VolumeAttributesClass featuregate.Feature = "VolumeAttributesClass"
	// CrossNamespaceVolumeDataSource allows a dataSourceRef in another namespace.
	CrossNamespaceVolumeDataSource featuregate.Feature = "CrossNamespaceVolumeDataSource"
)

// features are the provisioner's gates with upstream's maturity and defaults. GA gates are
// not locked so that manifests that still set them keep working.
func features() map[featuregate.Feature]featuregate.FeatureSpec {
	return map[featuregate.Feature]featuregate.FeatureSpec{
		Topology:                       {Default: true, PreRelease: featuregate.GA},
		VolumeAttributesClass:          {Default: true, PreRelease: featuregate.GA},
		CrossNamespaceVolumeDataSource: {Default: false, PreRelease: featuregate.Alpha},
	}
}

// options are the provisioner's own flags, with upstream external-provisioner's names and
// defaults (P9).
type options struct {
	volumeNamePrefix            string
	volumeNameUUIDLength        int
	timeout                     time.Duration
	workerThreads               uint
	retryIntervalStart          time.Duration
	retryIntervalMax            time.Duration
	extraCreateMetadata         bool
	defaultFSType               string
	strictTopology              bool
	immediateTopology           bool
	controllerPublishReadOnly   bool
	preventVolumeModeConversion bool
	cloningProtectionThreads    uint
	snapshotOrphanSweepInterval time.Duration

	nodeDeployment                 bool
	nodeDeploymentImmediateBinding bool
	nodeDeploymentBaseDelay        time.Duration
	nodeDeploymentMaxDelay         time.Duration
	// nodeName comes from the NODE_NAME environment variable, as upstream.
	nodeName string

	// Storage capacity tracking (package capacity).
	enableCapacity              bool
	capacityThreads             uint
	capacityPollInterval        time.Duration
	capacityForImmediateBinding bool
	capacityOwnerrefLevel       int
	kubeAPICapacityQPS          float32
	kubeAPICapacityBurst        int
	// capacityNamespace and podName come from the NAMESPACE (or POD_NAMESPACE) and
	// POD_NAME environment variables, as upstream.
	capacityNamespace string
	podName           string
}

func (o *options) addFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.volumeNamePrefix, "volume-name-prefix", "pvc", "Prefix to apply to the name of a created volume.")
	fs.IntVar(&o.volumeNameUUIDLength, "volume-name-uuid-length", -1, "Truncates generated UUID of a created volume to this length. Defaults behavior is to NOT truncate.")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Second, "Timeout for waiting for creation or deletion of a volume.")
	fs.UintVar(&o.workerThreads, "worker-threads", 100, "Number of provisioner worker threads, in other words nr. of simultaneous CSI calls.")
	fs.DurationVar(&o.retryIntervalStart, "retry-interval-start", time.Second, "Initial retry interval of failed provisioning or deletion. It doubles with each failure, up to retry-interval-max.")
	fs.DurationVar(&o.retryIntervalMax, "retry-interval-max", 5*time.Minute, "Maximum retry interval of failed provisioning or deletion.")
	fs.BoolVar(&o.extraCreateMetadata, "extra-create-metadata", false, "If set, add pv/pvc metadata to plugin create requests as parameters.")
	fs.StringVar(&o.defaultFSType, "default-fstype", "", "The default filesystem type of the volume to provision when fstype is unspecified in the StorageClass. If the default is not set and fstype is unset in the StorageClass, then no fstype will be set.")
	fs.BoolVar(&o.strictTopology, "strict-topology", false, "Late binding: pass only selected node topology to CreateVolume Request, unlike default behavior of passing aggregated cluster topologies that match with topology keys of the selected node.")
	fs.BoolVar(&o.immediateTopology, "immediate-topology", true, "Immediate binding: pass aggregated cluster topologies for all nodes where the CSI driver is available (enabled, the default) or no topology requirements (if disabled).")
	fs.BoolVar(&o.controllerPublishReadOnly, "controller-publish-readonly", false, "This option enables PV to be marked as readonly at controller publish volume call if PVC accessmode has been set to ROX.")
	fs.BoolVar(&o.preventVolumeModeConversion, "prevent-volume-mode-conversion", true, "Prevents an unauthorised user from modifying the volume mode when creating a PVC from an existing VolumeSnapshot.")
	fs.UintVar(&o.cloningProtectionThreads, "cloning-protection-threads", 1, "Number of simultaneously running threads, handling cloning finalizer removal.")
	fs.DurationVar(&o.snapshotOrphanSweepInterval, "snapshot-orphan-sweep-interval", 5*time.Minute, "How often VolumeSnapshots carrying the provisioner's source-protection finalizer are checked, so that a finalizer left behind (crash, claim deleted meanwhile) is removed. Set to 0 to disable the sweep.")

	fs.BoolVar(&o.nodeDeployment, "node-deployment", false, "Enables deploying the external-provisioner together with a CSI driver on nodes to manage node-local volumes.")
	fs.BoolVar(&o.nodeDeploymentImmediateBinding, "node-deployment-immediate-binding", true, "Determines whether immediate binding is supported when deployed on each node.")
	fs.DurationVar(&o.nodeDeploymentBaseDelay, "node-deployment-base-delay", 20*time.Second, "Determines how long the external-provisioner sleeps initially before trying to own a PVC with immediate binding.")
	fs.DurationVar(&o.nodeDeploymentMaxDelay, "node-deployment-max-delay", 60*time.Second, "Determines how long the external-provisioner sleeps at most before trying to own a PVC with immediate binding.")

	fs.BoolVar(&o.enableCapacity, "enable-capacity", false, "This enables producing CSIStorageCapacity objects with capacity information from the driver's GetCapacity call.")
	fs.UintVar(&o.capacityThreads, "capacity-threads", 1, "Number of simultaneously running threads, handling CSIStorageCapacity objects.")
	fs.DurationVar(&o.capacityPollInterval, "capacity-poll-interval", time.Minute, "How long the external-provisioner waits before checking for storage capacity changes.")
	fs.BoolVar(&o.capacityForImmediateBinding, "capacity-for-immediate-binding", false, "Enables producing capacity information for storage classes with immediate binding. Not needed for the Kubernetes scheduler, maybe useful for other consumers or for debugging.")
	fs.Float32Var(&o.kubeAPICapacityQPS, "kube-api-capacity-qps", 1, "QPS to use for storage capacity updates while communicating with the kubernetes apiserver.")
	fs.IntVar(&o.kubeAPICapacityBurst, "kube-api-capacity-burst", 5, "Burst to use for storage capacity updates while communicating with the kubernetes apiserver.")
	fs.IntVar(&o.capacityOwnerrefLevel, "capacity-ownerref-level", 1, "The level indicates the number of objects that need to be traversed starting from the pod identified by the POD_NAME and NAMESPACE environment variables to reach the owning object for CSIStorageCapacity objects: -1 for no owner, 0 for the pod itself, 1 for a StatefulSet or DaemonSet, 2 for a Deployment, etc.")
}

// validate checks what parsing cannot; each error names its flag (exit code 2).
func (o *options) validate(getenv func(string) string) error {
	var errs []error
	if o.volumeNamePrefix == "" {
		lifecycle.WarnFlag("volume-name-prefix", `""`, "volume names start with '-'")
	}
	// A UID without dashes has 32 characters: upstream accepts more at start and then
	// panics on the first claim; 0 would give every claim the same volume name.
	if o.volumeNameUUIDLength != -1 && (o.volumeNameUUIDLength < 1 || o.volumeNameUUIDLength > 32) {
		errs = append(errs, fmt.Errorf("--volume-name-uuid-length must be -1 (do not truncate) or between 1 and 32, got %d", o.volumeNameUUIDLength))
	}
	if o.timeout <= 0 {
		lifecycle.WarnFlag("timeout", o.timeout, "every CSI call times out at once")
	}
	if o.workerThreads == 0 {
		lifecycle.WarnFlag("worker-threads", o.workerThreads, "no workers: nothing is provisioned or deleted")
	}
	if o.cloningProtectionThreads == 0 {
		lifecycle.WarnFlag("cloning-protection-threads", o.cloningProtectionThreads, "cloning-protection finalizers are not removed")
	}
	if o.retryIntervalStart <= 0 {
		lifecycle.WarnFlag("retry-interval-start", o.retryIntervalStart, "failed operations are retried without delay")
	}
	if o.retryIntervalMax < o.retryIntervalStart {
		lifecycle.WarnFlag("retry-interval-max", o.retryIntervalMax, "retries wait at most this long, less than --retry-interval-start")
	}
	if o.enableCapacity {
		errs = append(errs, o.validateCapacity(getenv)...)
	}
	if o.nodeDeployment {
		o.nodeName = getenv("NODE_NAME")
		if o.nodeName == "" {
			errs = append(errs, errors.New("--node-deployment needs the NODE_NAME environment variable"))
		}
		if o.nodeDeploymentBaseDelay <= 0 || o.nodeDeploymentMaxDelay < o.nodeDeploymentBaseDelay {
			lifecycle.WarnFlag("node-deployment-base-delay", o.nodeDeploymentBaseDelay, "claims are taken with this delay, capped by --node-deployment-max-delay")
		}
	}
	return errors.Join(errs...)
}

// validateCapacity checks the capacity flags and reads the environment they need: the
// namespace of the objects (NAMESPACE as upstream, POD_NAMESPACE as older upstream
// releases) and, for an owner, the pod (POD_NAME).
func (o *options) validateCapacity(getenv func(string) string) []error {
	var errs []error
	if o.capacityThreads == 0 {
		lifecycle.WarnFlag("capacity-threads", o.capacityThreads, "no workers: CSIStorageCapacity objects are not written")
	}
	if o.capacityPollInterval <= 0 {
		lifecycle.WarnFlag("capacity-poll-interval", o.capacityPollInterval, "capacity is not polled, only refreshed on changes (upstream would poll without pause)")
	}
	// client-go's rules, as for --kube-api-qps.
	if o.kubeAPICapacityQPS > 0 && o.kubeAPICapacityBurst <= 0 {
		errs = append(errs, fmt.Errorf("--kube-api-capacity-burst must be positive when --kube-api-capacity-qps is (%v), got %d", o.kubeAPICapacityQPS, o.kubeAPICapacityBurst))
	}
	if o.capacityNamespace = getenv("NAMESPACE"); o.capacityNamespace == "" {
		o.capacityNamespace = getenv("POD_NAMESPACE")
	}
	if o.capacityNamespace == "" {
		errs = append(errs, errors.New("--enable-capacity needs the NAMESPACE environment variable: the namespace of the CSIStorageCapacity objects"))
	}
	if o.capacityOwnerrefLevel >= 0 {
		if o.podName = getenv("POD_NAME"); o.podName == "" {
			errs = append(errs, fmt.Errorf("--capacity-ownerref-level=%d needs the POD_NAME environment variable (-1: objects without owner)", o.capacityOwnerrefLevel))
		}
	}
	return errs
}
