package lifecycle

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/component-base/featuregate"
	logsapi "k8s.io/component-base/logs/api/v1"

	// Registers --logging-format=json.
	_ "k8s.io/component-base/logs/json/register"
)

// ReleaseLeaderElectionOnExit is upstream's gate for releasing the Lease on exit. It is
// accepted so existing manifests keep working; the core always drains and releases (P2), so
// it only matters when turned off: then the Lease is never released and expires on its own.
const ReleaseLeaderElectionOnExit featuregate.Feature = "ReleaseLeaderElectionOnExit"

const serviceAccountNamespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// Options are the flags every sidecar shares, with upstream names and defaults.
type Options struct {
	CSIAddress string
	Kubeconfig string
	Master     string

	LeaderElection          bool
	LeaderElectionNamespace string
	LeaderElectionIdentity  string
	LeaseDuration           time.Duration
	RenewDeadline           time.Duration
	RetryPeriod             time.Duration
	LeaderElectionLabels    map[string]string

	KubeAPIQPS   float64
	KubeAPIBurst int

	HTTPEndpoint   string
	MetricsAddress string
	MetricsPath    string

	DrainTimeout time.Duration
	Automaxprocs bool
	EnablePprof  bool
	// MaxGRPCLogLength caps every CSI response logged at -v=5 (requests are logged whole);
	// not positive: no cap.
	MaxGRPCLogLength int
	// LogBacklogInterval is --log-backlog-interval: how often queues with items waiting
	// are logged; 0 is off.
	LogBacklogInterval time.Duration
	// ShowVersion is --version: print the version and exit 0.
	ShowVersion bool

	// Gates holds the core's and the sidecars' feature gates (--feature-gates).
	Gates featuregate.MutableVersionedFeatureGate
	// Logging is component-base's logging configuration (-v, --vmodule, --logging-format).
	Logging *logsapi.LoggingConfiguration

	// Getenv and Hostname read the environment; tests replace them.
	Getenv   func(string) string
	Hostname func() (string, error)
	// ReadFile reads the service-account namespace file; tests replace it.
	ReadFile func(string) ([]byte, error)
}

// NewOptions returns the options with upstream defaults and the core's feature gates.
func NewOptions() *Options {
	o := &Options{
		CSIAddress:           "/run/csi/socket",
		LeaseDuration:        15 * time.Second,
		RenewDeadline:        10 * time.Second,
		RetryPeriod:          5 * time.Second,
		LeaderElectionLabels: map[string]string{},
		KubeAPIQPS:           5,
		KubeAPIBurst:         10,
		MetricsPath:          "/metrics",
		DrainTimeout:         20 * time.Second,
		MaxGRPCLogLength:     -1,
		Gates:                featuregate.NewFeatureGate(),
		Logging:              logsapi.NewLoggingConfiguration(),
		Getenv:               os.Getenv,
		Hostname:             os.Hostname,
		ReadFile:             os.ReadFile,
	}
	// Both only fail on a name clash, which is a programming error.
	if err := o.Gates.Add(map[featuregate.Feature]featuregate.FeatureSpec{
		ReleaseLeaderElectionOnExit: {Default: true, PreRelease: featuregate.Beta},
	}); err != nil {
		panic(err)
	}
	if err := logsapi.AddFeatureGates(o.Gates); err != nil {
		panic(err)
	}
	return o
}

// AddFlags registers the shared flags on fs.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.CSIAddress, "csi-address", o.CSIAddress, "Address of the CSI driver socket.")
	fs.StringVar(&o.Kubeconfig, "kubeconfig", o.Kubeconfig, "Absolute path to the kubeconfig file. Required only when running out of cluster. Default: the KUBECONFIG environment variable, else in-cluster.")
	fs.StringVar(&o.Master, "master", o.Master, "Master URL to build a client config from. Either this or kubeconfig needs to be set when running out of cluster.")
	fs.BoolVar(&o.ShowVersion, "version", o.ShowVersion, "Show the version and exit.")

	fs.BoolVar(&o.LeaderElection, "leader-election", o.LeaderElection, "Enable leader election.")
	fs.StringVar(&o.LeaderElectionNamespace, "leader-election-namespace", o.LeaderElectionNamespace, "Namespace where the leader election resource lives. Defaults to the pod namespace if not set.")
	fs.StringVar(&o.LeaderElectionIdentity, "leader-election-identity", o.LeaderElectionIdentity, "Identity of this replica in the leader election Lease. Defaults to the POD_NAME environment variable, else the host name.")
	fs.DurationVar(&o.LeaseDuration, "leader-election-lease-duration", o.LeaseDuration, "Duration that non-leader candidates will wait to force acquire leadership.")
	fs.DurationVar(&o.RenewDeadline, "leader-election-renew-deadline", o.RenewDeadline, "Duration that the acting leader will retry refreshing leadership before giving up.")
	fs.DurationVar(&o.RetryPeriod, "leader-election-retry-period", o.RetryPeriod, "Duration the leader elector clients should wait between tries of actions.")
	fs.Var(labelsValue{&o.LeaderElectionLabels}, "leader-election-labels", "List of labels to add to the Lease when this replica becomes leader, as key:value pairs separated by commas. Example: 'my-label:my-value,my-second-label:my-second-value'")

	fs.Float64Var(&o.KubeAPIQPS, "kube-api-qps", o.KubeAPIQPS, "QPS to use while communicating with the kubernetes apiserver.")
	fs.IntVar(&o.KubeAPIBurst, "kube-api-burst", o.KubeAPIBurst, "Burst to use while communicating with the kubernetes apiserver.")

	fs.StringVar(&o.HTTPEndpoint, "http-endpoint", o.HTTPEndpoint, "The TCP network address where the HTTP server for diagnostics, including metrics and leader election health check, will listen (example: `:8080`). The default is empty string, which means the server is disabled. Only one of --metrics-address and --http-endpoint can be set.")
	fs.StringVar(&o.MetricsAddress, "metrics-address", o.MetricsAddress, "(deprecated) The TCP network address where the prometheus metrics endpoint will listen (example: `:8080`). The default is empty string, which means metrics endpoint is disabled. Only one of --metrics-address and --http-endpoint can be set.")
	_ = fs.MarkDeprecated("metrics-address", "use --http-endpoint instead")
	fs.StringVar(&o.MetricsPath, "metrics-path", o.MetricsPath, "The HTTP path where prometheus metrics will be exposed.")

	fs.DurationVar(&o.DrainTimeout, "drain-timeout", o.DrainTimeout, "How long in-flight operations may run after the first SIGTERM before they are cancelled and the process exits without releasing the Lease. Keep it below the pod's terminationGracePeriodSeconds.")
	fs.BoolVar(&o.Automaxprocs, "automaxprocs", o.Automaxprocs, "Set GOMAXPROCS from the container's CPU quota.")
	fs.BoolVar(&o.EnablePprof, "enable-pprof", o.EnablePprof, "Enable pprof profiling on the TCP network address specified by --http-endpoint. The HTTP path is `/debug/pprof/`.")
	fs.DurationVar(&o.LogBacklogInterval, "log-backlog-interval", o.LogBacklogInterval, "How often to log every work queue that has items waiting for a worker, with their number and the age of the oldest. 0 (the default) is off.")
	fs.IntVar(&o.MaxGRPCLogLength, "max-grpc-log-length", o.MaxGRPCLogLength, "The maximum amount of characters logged for every grpc responses. Defaults to no limit")

	o.Gates.AddFlag(fs)
	logsapi.AddFlags(o.Logging, fs)
}

// Validate checks the values after parsing and fills in derived defaults (namespace,
// identity). Every error names the flag at fault.
func (o *Options) Validate() error {
	var errs []error
	if o.CSIAddress == "" {
		errs = append(errs, errors.New("--csi-address must not be empty"))
	}
	if o.HTTPEndpoint != "" && o.MetricsAddress != "" {
		errs = append(errs, errors.New("only one of --metrics-address and --http-endpoint can be set"))
	}
	// client-go's rules: QPS 0 is its default (5), a negative QPS means no client-side limit;
	// a burst is needed only with a limit.
	if o.KubeAPIQPS > 0 && o.KubeAPIBurst <= 0 {
		errs = append(errs, fmt.Errorf("--kube-api-burst must be positive when --kube-api-qps is (%v), got %d", o.KubeAPIQPS, o.KubeAPIBurst))
	}
	if o.DrainTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--drain-timeout must be positive, got %v", o.DrainTimeout))
	}
	if !strings.HasPrefix(o.MetricsPath, "/") {
		errs = append(errs, fmt.Errorf("--metrics-path must start with '/', got %q", o.MetricsPath))
	}
	if o.LeaderElection {
		errs = append(errs, o.validateLeaderElection()...)
	}
	if err := logsapi.Validate(o.Logging, o.Gates, nil).ToAggregate(); err != nil {
		errs = append(errs, fmt.Errorf("logging flags (-v, --vmodule, --logging-format): %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return o.fillDefaults()
}

// validateLeaderElection applies client-go's rules, so they fail at start-up with the flag's
// name instead of later inside the elector.
func (o *Options) validateLeaderElection() []error {
	var errs []error
	if o.LeaseDuration < time.Second {
		errs = append(errs, fmt.Errorf("--leader-election-lease-duration must be at least 1s, got %v", o.LeaseDuration))
	}
	if o.RenewDeadline <= 0 {
		errs = append(errs, fmt.Errorf("--leader-election-renew-deadline must be positive, got %v", o.RenewDeadline))
	}
	if o.RetryPeriod <= 0 {
		errs = append(errs, fmt.Errorf("--leader-election-retry-period must be positive, got %v", o.RetryPeriod))
	}
	// A leader that cannot renew fences itself renew-deadline after its last renewal
	// started; a standby that saw that renewal may take the Lease the record's duration
	// (whole seconds) after it saw it. The first must come strictly before the second (P11).
	if recorded := o.LeaseDuration.Truncate(time.Second); o.RenewDeadline >= recorded {
		errs = append(errs, fmt.Errorf("--leader-election-renew-deadline (%v) must be shorter than --leader-election-lease-duration in whole seconds (%v): "+
			"a leader that cannot renew stops every CSI call renew-deadline after its last renewal started, "+
			"which must be before a standby may take the Lease, a lease duration after it saw that renewal", o.RenewDeadline, recorded))
	}
	if float64(o.RenewDeadline) <= 1.2*float64(o.RetryPeriod) {
		errs = append(errs, fmt.Errorf("--leader-election-renew-deadline (%v) must be greater than 1.2 x --leader-election-retry-period (%v)", o.RenewDeadline, o.RetryPeriod))
	}
	return errs
}

// ApplyLogging configures klog from the logging flags. klog is process-wide, so this runs
// once, from the command, after Validate.
func (o *Options) ApplyLogging() error {
	if err := logsapi.ValidateAndApply(o.Logging, o.Gates); err != nil {
		return fmt.Errorf("logging flags (-v, --vmodule, --logging-format): %w", err)
	}
	return nil
}

func (o *Options) fillDefaults() error {
	if o.Kubeconfig == "" {
		o.Kubeconfig = o.Getenv("KUBECONFIG")
	}
	if o.LeaderElectionNamespace == "" {
		o.LeaderElectionNamespace = o.podNamespace()
	}
	if o.LeaderElectionIdentity == "" {
		id := o.Getenv("POD_NAME")
		if id == "" {
			host, err := o.Hostname()
			if err != nil {
				return fmt.Errorf("--leader-election-identity is not set and the host name is unknown: %w", err)
			}
			id = host
		}
		o.LeaderElectionIdentity = id
	}
	o.LeaderElectionIdentity = SanitizeName(o.LeaderElectionIdentity)
	return nil
}

func (o *Options) podNamespace() string {
	if ns := o.Getenv("POD_NAMESPACE"); ns != "" {
		return ns
	}
	if data, err := o.ReadFile(serviceAccountNamespaceFile); err == nil {
		if ns := strings.TrimSpace(string(data)); ns != "" {
			return ns
		}
	}
	return "default"
}

// SanitizeName turns a driver or host name into a valid Lease name or holder identity the
// way upstream sidecars do, so Lease names match theirs (P9): every character other than
// letters, digits and '-' becomes '-', and a trailing '-' gets an 'X' appended.
func SanitizeName(name string) string {
	b := []byte(name)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
			b[i] = '-'
		}
	}
	if len(b) > 0 && b[len(b)-1] == '-' {
		b = append(b, 'X')
	}
	return string(b)
}

// labelsValue parses --leader-election-labels ("k:v,k2:v2") as upstream does.
type labelsValue struct{ m *map[string]string }

func (v labelsValue) String() string {
	if v.m == nil {
		return ""
	}
	pairs := make([]string, 0, len(*v.m))
	for k, val := range *v.m {
		pairs = append(pairs, k+":"+val)
	}
	sort.Strings(pairs)
	return strings.Join(pairs, ",")
}

// Set merges s into the labels: a repeated flag adds to the earlier ones, and a later key
// wins, as upstream.
func (v labelsValue) Set(s string) error {
	m := *v.m
	if m == nil {
		m = map[string]string{}
	}
	for _, pair := range strings.Split(s, ",") {
		if pair == "" {
			continue
		}
		k, val, ok := strings.Cut(pair, ":")
		if !ok || k == "" {
			return fmt.Errorf("malformed label %q, want key:value", pair)
		}
		m[strings.TrimSpace(k)] = strings.TrimSpace(val)
	}
	*v.m = m
	return nil
}

func (labelsValue) Type() string { return "key:value,..." }
