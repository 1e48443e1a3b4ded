// Package registrar is csi-sidecars' node-driver-registrar: it registers the node's CSI
// driver with the kubelet, through the kubelet's plugin registration API, as upstream's
// node-driver-registrar v2.17.0 does, with the same flags and defaults. It runs on every
// replica and never leads (a lifecycle.Server).
//
// The kubelet's plugin watcher registers a driver when a socket appears in its plugin
// registration folder, and unregisters it, by name, when that file is removed or replaced
// by another file of the same name. Upstream removes its socket on SIGTERM and removes
// whatever file it finds at start, so every rollout takes the driver out of the node's
// CSINode for a while, and two pods on one node unregister each other's socket for good.
// This registrar keeps the socket instead (keeper.go):
//
//   - it never removes a socket file: one that a process still serves is left to it, and
//     one that nobody serves is replaced in one step (a rename), never unlinked;
//   - on SIGTERM it leaves its socket in place, so the kubelet keeps the driver registered;
//     the registration it answered last keeps running until the kubelet reports its result;
//   - a registrar that starts while another serves the socket waits beside it and is handed
//     the listening socket itself when the other stops (handover.go): the kubelet sees no
//     change at all, which makes a DaemonSet's maxSurge rollout free of any gap;
//   - it checks its socket every second, and places it again when it was removed or replaced
//     by a file that nobody serves.
package registrar

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Name is the sidecar's subcommand.
const Name = "node-driver-registrar"

// modeRegistrationProbe is upstream's deprecated --mode whose process exits 0 at once (old
// manifests ran it as the container's exec liveness probe).
const modeRegistrationProbe = "kubelet-registration-probe"

// Sidecar is the node-driver-registrar.
type Sidecar struct {
	kubeletRegistrationPath string
	pluginRegistrationPath  string
	timeout                 time.Duration
	healthPort              int
	mode                    string
	connectionTimeout       time.Duration
	// checkEvery is how often the socket is checked; tests shorten it.
	checkEvery time.Duration
}

var (
	_ lifecycle.Server              = &Sidecar{}
	_ lifecycle.FlagValidator       = &Sidecar{}
	_ lifecycle.SharedFlagValidator = &Sidecar{}
)

// New returns the sidecar with upstream's defaults.
func New() *Sidecar {
	return &Sidecar{pluginRegistrationPath: "/registration", timeout: time.Second, checkEvery: time.Second}
}

// Name implements lifecycle.Server.
func (s *Sidecar) Name() string { return Name }

// AddFlags implements lifecycle.Server with upstream's flags and defaults.
func (s *Sidecar) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&s.kubeletRegistrationPath, "kubelet-registration-path", s.kubeletRegistrationPath, "Path of the CSI driver socket on the Kubernetes host machine.")
	fs.StringVar(&s.pluginRegistrationPath, "plugin-registration-path", s.pluginRegistrationPath, "Path to Kubernetes plugin registration directory.")
	fs.DurationVar(&s.timeout, "timeout", s.timeout, "Timeout for waiting for communication with driver")
	fs.IntVar(&s.healthPort, "health-port", s.healthPort, "(deprecated) TCP port for healthz requests. Set to 0 to disable the healthz server. Only one of `--health-port` and `--http-endpoint` can be set.")
	fs.StringVar(&s.mode, "mode", s.mode, "DEPRECATED: the only value with an effect is kubelet-registration-probe, which exits 0 at once.")
	fs.DurationVar(&s.connectionTimeout, "connection-timeout", s.connectionTimeout, "The --connection-timeout flag is deprecated")
}

// ValidateFlags implements lifecycle.FlagValidator: what upstream refuses.
func (s *Sidecar) ValidateFlags() error {
	if s.kubeletRegistrationPath == "" {
		return errors.New("--kubelet-registration-path is a required parameter")
	}
	if s.connectionTimeout != 0 {
		lifecycle.WarnFlag("connection-timeout", s.connectionTimeout, "none: the flag is deprecated, as upstream's")
	}
	return nil
}

// ValidateSharedFlags implements lifecycle.SharedFlagValidator: upstream serves /healthz on
// one of the two addresses.
func (s *Sidecar) ValidateSharedFlags(shared *lifecycle.Options) error {
	if s.healthPort > 0 && shared.HTTPEndpoint != "" {
		return errors.New("only one of `--health-port` and `--http-endpoint` can be set")
	}
	return nil
}

// Serve implements lifecycle.Server: it asks the driver its name, then keeps the
// registration socket <plugin-registration-path>/<driver>-reg.sock until intake ends.
func (s *Sidecar) Serve(intake context.Context, env *lifecycle.ServerEnv) error {
	if s.mode == modeRegistrationProbe {
		return lifecycle.ErrNothingToServe
	}
	logger := klog.FromContext(intake)
	if s.mode != "" {
		logger.Info("Ignoring --mode: only kubelet-registration-probe has an effect", "mode", s.mode)
	}
	driver, err := env.DriverName(intake)
	if err != nil {
		if intake.Err() != nil {
			return nil
		}
		return err
	}
	// Upstream joins the two with a slash, not filepath.Join: the same string here.
	path := fmt.Sprintf("%s/%s-reg.sock", s.pluginRegistrationPath, driver)
	reg := newRegistration(driver, s.kubeletRegistrationPath)
	k := newKeeper(path, reg, s.checkEvery)
	check := func(r *http.Request) error { return k.check(r.Context(), driver, s.timeout) }
	env.AddHealthCheck("registration socket "+path, check)
	if s.healthPort > 0 {
		stop, err := serveHealth(intake, net.JoinHostPort("", strconv.Itoa(s.healthPort)), check)
		if err != nil {
			return err
		}
		defer stop()
	}
	logger.Info("Registering the CSI driver with the kubelet", "driver", driver, "socket", path, "kubeletRegistrationPath", s.kubeletRegistrationPath)
	return k.run(intake, env.Ops())
}

// serveHealth serves check on addr's /healthz (the deprecated --health-port).
func serveHealth(ctx context.Context, addr string, check func(*http.Request) error) (func(), error) {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if err := check(r); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		fmt.Fprint(w, "ok")
	})
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listening on --health-port %s: %w", addr, err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			klog.FromContext(ctx).Error(err, "Health server stopped", "address", addr)
		}
	}()
	return func() { _ = srv.Close() }, nil
}
