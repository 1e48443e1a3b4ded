package lifecycle

import (
	"context"
	"errors"
	"time"

	"github.com/kubernetes-csi/csi-lib-utils/metrics"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	"google.golang.org/grpc"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/component-base/featuregate"
)

// Sidecar is one controller the core hosts: it works on API objects while this replica
// holds its Lease (or always, without leader election).
type Sidecar interface {
	Hosted
	// LeaseName is the upstream-compatible Lease name for a driver (before sanitising).
	LeaseName(driver string) string
	// Setup runs on every replica once the driver is probed: it builds listers, queues and
	// handlers and registers its informers on env.Informers, so caches are warm on standbys
	// too (P7). A returned UsageError exits 2, any other error exits 1.
	Setup(env *Env) error
	// Run is called when this replica leads. It starts workers and returns only after
	// intake is done (queues shut down, periodic loops stopped) and every worker has
	// returned. Each operation runs on env.Ops(), never on intake (P1).
	Run(intake context.Context, env *Env) error
}

// FeatureGated is implemented by a sidecar that has feature gates of its own; they are
// added to the shared --feature-gates flag.
type FeatureGated interface {
	Features() map[featuregate.Feature]featuregate.FeatureSpec
}

// CallTimeout is implemented by a sidecar with a --timeout for its CSI calls; it also
// bounds each driver probe at start, as upstream.
type CallTimeout interface {
	CallTimeout() time.Duration
}

// Env is what the core hands a sidecar: shared clients, caches and the CSI connection, and
// the sidecar's own Ops() context.
type Env struct {
	// Kube is the sidecar's own clientset for its work, rate limited by --kube-api-qps and
	// --kube-api-burst (per sidecar, also when several share a process).
	Kube kubernetes.Interface
	// RestConfig builds further clients (CRDs); it carries the same limits as Kube, and
	// JSON (Kube speaks protobuf, which custom resources do not have).
	RestConfig *rest.Config
	// Informers is the process's shared informer factory; the core starts it on every
	// replica after every Setup, and waits for its caches before leading.
	Informers informers.SharedInformerFactory
	// CacheTransform is the transform of Informers' caches (NewCacheTransform): informers
	// a sidecar runs itself (a CRD's) use it too, so their objects share the process's
	// table of repeated maps and strings.
	CacheTransform cache.TransformFunc
	// Events is the sidecar's event broadcaster, writing through Kube (its budget); a
	// sidecar makes its own recorder from it.
	Events record.EventBroadcaster
	// CSI is the driver connection. Every call through it is counted as in flight, and is
	// cancelled when Ops() is (fencing, P6), whatever context the caller passed.
	CSI grpc.ClientConnInterface
	// DriverName is the name the driver reported in GetPluginInfo.
	DriverName string
	// PluginCapabilities and ControllerCapabilities are what the driver reported at probe.
	PluginCapabilities     rpc.PluginCapabilitySet
	ControllerCapabilities rpc.ControllerCapabilitySet
	// Metrics records CSI call metrics (csi_sidecar_operations_seconds); its registry is the
	// one served on --metrics-path.
	Metrics metrics.CSIMetricsManager
	// Gates holds the parsed feature gates.
	Gates featuregate.FeatureGate
	// Identity is this replica's leader-election identity.
	Identity string
	// Backlog collects what the sidecar's queues (NewQueue) have waiting, for /metrics
	// (csi_sidecars_queue_waiting_items, csi_sidecars_queue_oldest_waiting_seconds) and
	// --log-backlog-interval. The core's holds its queues' items until the sidecar leads.
	Backlog *Backlog

	ops  context.Context
	done <-chan struct{}
}

// Done is closed when the process ends: the stop channel of informers a sidecar runs
// itself, outside Informers (a CRD's, or one restricted to a namespace). Start them in
// Setup, so standbys have them warm too (P7).
func (e *Env) Done() <-chan struct{} { return e.done }

// WithOps returns a copy of e whose Ops() is ops. The core gives each hosted sidecar its
// own; a sidecar's unit tests use it to build an Env.
func (e Env) WithOps(ops context.Context) *Env {
	e.ops = ops
	return &e
}

// Ops is the parent context of in-flight operations: a CSI call and the API writes that
// record its result. The first signal does not cancel it; the drain deadline and losing the
// Lease do (P1, P3, P6).
func (e *Env) Ops() context.Context { return e.ops }

// UsageError marks a Setup error as a configuration problem (exit code 2), for example a
// driver that lacks every capability the sidecar could use.
type UsageError struct{ Err error }

func (e UsageError) Error() string { return e.Err.Error() }
func (e UsageError) Unwrap() error { return e.Err }

// IsUsageError tells whether err is, or wraps, a UsageError.
func IsUsageError(err error) bool {
	var u UsageError
	return errors.As(err, &u)
}
