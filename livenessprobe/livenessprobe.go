// Package livenessprobe is `csi-sidecars livenessprobe`, a drop-in for the Kubernetes CSI
// livenessprobe v2.19: the kubelet's liveness probe of the driver container asks /healthz,
// and each request is one CSI Probe call to the driver, answered 200 "ok" when the driver
// is ready and 500 otherwise (with the error, or "driver responded but is not ready" when it
// reports ready=false; a Probe answer without ready counts as ready, as upstream's).
//
// It is a lifecycle.Server: it runs on every replica, with no Lease and no API server, on the
// core's reconnecting driver connection. A driver that restarts (its container restarted by
// this very probe) is dialled again; the probe answers 500 while it is down and 200 once it
// answers again, and the process goes on.
//
// # Where the probe answers
//
// Upstream serves /healthz on --http-endpoint when it is set (with its metrics on the same
// mux), else on 0.0.0.0:<--health-port> (9808 by default, with no metrics there). Here:
//
//   - Alone (the subcommand, or --controllers=livenessprobe) with --http-endpoint set: the
//     probe is the diagnostics server's /healthz, beside --metrics-path, as upstream's one
//     mux. The core's own /healthz is replaced, and the health port is not listened on.
//   - Otherwise the probe listens on its own at 0.0.0.0:<health port> and serves /healthz
//     only, as upstream. Its metrics are on --http-endpoint or --metrics-address, if set.
//   - In combined mode (with other sidecars) always on its own port,
//     --livenessprobe-health-port: the process's --http-endpoint stays the sidecar
//     container's own diagnostics, whose /healthz is the process's liveness, not the
//     driver's. A probe failure must restart the driver container, not the sidecars'.
//
// An explicit --health-port other than 9808 together with --http-endpoint is refused, as
// upstream refuses it (the comparison is with the string "9808", as upstream's); in combined
// mode the two mean different servers and do not conflict.
//
// # Differences from upstream
//
//   - Upstream listens only once the driver answered GetPluginInfo (and exits 1 if it reports
//     no name). Here the probe listens at once and answers 500 until the driver answers: the
//     kubelet's probe fails either way (connection refused there, 500 here). The driver's
//     name is asked in the background, so the CSI call metrics carry it.
//   - Upstream dials the driver afresh for every probe; here the probe uses the core's one
//     connection, so --probe-timeout bounds the wait for it and the Probe together, as
//     upstream's dial and Probe share one budget.
//   - A refused flag combination exits 2 here (upstream: 1), as every usage error of the
//     core. A port that cannot be listened on exits 1 (upstream logs it and exits 0, a
//     quirk: the kubelet would see a container that completed).
//   - On SIGTERM upstream dies at once. Here the probe stops taking requests, the ones in
//     flight get their answer, and the process exits 0 (or 1 at --drain-timeout).
package livenessprobe

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/go-logr/logr"
	"github.com/spf13/pflag"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// defaultHealthPort is upstream's --health-port.
const defaultHealthPort = "9808"

// notReady is upstream's answer when the driver reports ready=false.
const notReady = "driver responded but is not ready"

// Sidecar is the livenessprobe.
type Sidecar struct {
	probeTimeout time.Duration
	healthPort   string
	// healthPortFlag is the subcommand's --health-port. It is marked changed only when given
	// to the subcommand; combined mode's --livenessprobe-health-port is another flag on the
	// same value.
	healthPortFlag *pflag.Flag
}

// New returns the livenessprobe sidecar.
func New() *Sidecar { return &Sidecar{} }

var (
	_ lifecycle.Server              = &Sidecar{}
	_ lifecycle.FlagValidator       = &Sidecar{}
	_ lifecycle.SharedFlagValidator = &Sidecar{}
)

// Name implements lifecycle.Hosted.
func (*Sidecar) Name() string { return "livenessprobe" }

// AddFlags implements lifecycle.Hosted with livenessprobe v2.19's own flags and defaults;
// --csi-address, --http-endpoint, --metrics-address and --metrics-path are shared.
func (s *Sidecar) AddFlags(fs *pflag.FlagSet) {
	fs.DurationVar(&s.probeTimeout, "probe-timeout", 3*time.Second, "Probe timeout in seconds.")
	fs.StringVar(&s.healthPort, "health-port", defaultHealthPort, "(deprecated) TCP ports for listening healthz requests. The default is "+defaultHealthPort+". If set, --http-endpoint cannot be set.")
	s.healthPortFlag = fs.Lookup("health-port")
}

// ValidateFlags implements lifecycle.FlagValidator. Upstream refuses no value of its own
// flags: a --probe-timeout of 0 or less makes every probe fail, and is warned of.
func (s *Sidecar) ValidateFlags() error {
	if s.probeTimeout <= 0 {
		lifecycle.WarnFlag("probe-timeout", s.probeTimeout, "every probe fails at once: the driver container is restarted again and again")
	}
	return nil
}

// ValidateSharedFlags implements lifecycle.SharedFlagValidator: upstream refuses a
// --health-port other than its default together with --http-endpoint, which then decides
// where the probe answers. It keeps --http-endpoint for Serve.
func (s *Sidecar) ValidateSharedFlags(shared *lifecycle.Options) error {
	if s.healthPortFlag != nil && s.healthPortFlag.Changed && s.healthPort != defaultHealthPort && shared.HTTPEndpoint != "" {
		return errors.New("only one of --health-port and --http-endpoint can be explicitly set")
	}
	return nil
}

// Serve implements lifecycle.Server: it answers /healthz until intake ends, then lets the
// probes in flight finish and returns.
func (s *Sidecar) Serve(intake context.Context, env *lifecycle.ServerEnv) error {
	logger := klog.FromContext(intake)
	// The driver's name only labels the CSI call metrics: the probe does not wait for it.
	naming, stopNaming := context.WithCancel(intake)
	named := make(chan struct{})
	go func() {
		defer close(named)
		if name, err := env.DriverName(naming); err == nil {
			logger.Info("CSI driver name", "driver", name)
		}
	}()
	defer func() {
		stopNaming()
		<-named
	}()

	probe := &probe{identity: csi.NewIdentityClient(env.CSI), timeout: s.probeTimeout, logger: logger}
	if env.Alone && env.HTTPEndpoint != "" {
		if s.healthPort != defaultHealthPort {
			// Only --controllers=livenessprobe gets here: the subcommand refuses it.
			lifecycle.WarnFlag("livenessprobe-health-port", s.healthPort, "ignored: the probe answers on --http-endpoint, as when the livenessprobe runs alone")
		}
		gate := &gate{}
		if env.HandleDiagnostics("/healthz", gate.wrap(probe)) {
			logger.Info("Serving the liveness probe on the diagnostics server", "address", env.HTTPEndpoint, "path", "/healthz")
			<-intake.Done()
			return gate.close(env.Ops())
		}
	}
	return s.listen(intake, env, probe)
}

// listen serves the probe on its own port until intake ends.
func (s *Sidecar) listen(intake context.Context, env *lifecycle.ServerEnv, probe http.Handler) error {
	addr := net.JoinHostPort("0.0.0.0", s.healthPort)
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listening on --health-port %s: %w", s.healthPort, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/healthz", probe)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	klog.FromContext(intake).Info("Serving the liveness probe", "address", l.Addr().String(), "path", "/healthz")
	select {
	case err := <-served:
		return fmt.Errorf("serving the liveness probe on %s: %w", addr, err)
	case <-intake.Done():
	}
	// No new probe; those in flight get their answer, until the drain deadline.
	if err := srv.Shutdown(env.Ops()); err != nil {
		_ = srv.Close()
		return fmt.Errorf("stopping the liveness probe on %s: %w", addr, err)
	}
	return nil
}

// probe answers /healthz with one Probe call to the driver.
type probe struct {
	identity csi.IdentityClient
	timeout  time.Duration
	logger   logr.Logger
}

func (p *probe) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), p.timeout)
	defer cancel()
	rsp, err := p.identity.Probe(ctx, &csi.ProbeRequest{})
	switch {
	case err != nil:
		p.logger.Error(err, "Health check failed")
		answer(w, http.StatusInternalServerError, err.Error())
	case rsp.GetReady() != nil && !rsp.GetReady().GetValue():
		p.logger.Error(nil, "Driver responded but is not ready")
		answer(w, http.StatusInternalServerError, notReady)
	default:
		p.logger.V(5).Info("Health check succeeded")
		answer(w, http.StatusOK, "ok")
	}
}

// answer writes code and body as upstream does: plain text, no trailing newline.
func answer(w http.ResponseWriter, code int, body string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(body))
}

// gate lets the probes through until it is closed, and counts those in flight: on the
// diagnostics server, which the core stops only after the drain, it is what stops taking
// new probes.
type gate struct {
	mu       sync.Mutex
	closed   bool
	inflight sync.WaitGroup
}

func (g *gate) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.mu.Lock()
		if g.closed {
			g.mu.Unlock()
			answer(w, http.StatusServiceUnavailable, "shutting down")
			return
		}
		g.inflight.Add(1)
		g.mu.Unlock()
		defer g.inflight.Done()
		h.ServeHTTP(w, r)
	})
}

// close turns new probes away and waits for those in flight until ctx ends.
func (g *gate) close(ctx context.Context) error {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
	done := make(chan struct{})
	go func() {
		g.inflight.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("waiting for the probes in flight: %w", context.Cause(ctx))
	}
}
