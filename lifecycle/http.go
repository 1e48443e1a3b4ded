package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2"

	// Registers client-go's workqueue metrics (workqueue_depth{name}, ...) in the legacy
	// registry; the provider is process-wide in client-go, so queue names must be unique.
	_ "k8s.io/component-base/metrics/prometheus/workqueue"

	// Registers client-go's leader-election metrics (leader_election_master_status{name},
	// named after the Lease) in the legacy registry, as upstream's sidecars serve them.
	_ "k8s.io/component-base/metrics/prometheus/clientgo/leaderelection"
)

// leaderHealthTimeout is how long a leader may go without renewing its Lease before
// /healthz/leader-election fails, as upstream.
const leaderHealthTimeout = 20 * time.Second

// health tracks what /readyz and /healthz/leader-election report. Standbys serve both too.
type health struct {
	mu       sync.Mutex
	notReady string // why the process is not ready; "" when ready
	electors []*leaderelection.HealthzAdaptor
}

func (h *health) setNotReady(reason string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.notReady = reason
}

func (h *health) newElectorCheck() *leaderelection.HealthzAdaptor {
	a := leaderelection.NewLeaderHealthzAdaptor(leaderHealthTimeout)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.electors = append(h.electors, a)
	return a
}

func (h *health) readyz(w http.ResponseWriter, _ *http.Request) {
	h.mu.Lock()
	reason := h.notReady
	h.mu.Unlock()
	if reason != "" {
		http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
		return
	}
	fmt.Fprint(w, "ok")
}

func (h *health) leaderElection(w http.ResponseWriter, r *http.Request) {
	h.mu.Lock()
	electors := append([]*leaderelection.HealthzAdaptor(nil), h.electors...)
	h.mu.Unlock()
	for _, e := range electors {
		if err := e.Check(r); err != nil {
			http.Error(w, fmt.Sprintf("internal server error: %v", err), http.StatusInternalServerError)
			return
		}
	}
	fmt.Fprint(w, "ok")
}

// diagnostics is the diagnostics server's mux, with the /healthz that Servers may extend
// (ServerEnv.AddHealthCheck) or replace (ServerEnv.HandleDiagnostics).
type diagnostics struct {
	mux *http.ServeMux

	mu      sync.Mutex
	healthz http.Handler // a Server's, in place of the checks; nil: the checks
	checks  []healthCheck
}

type healthCheck struct {
	name  string
	check func(r *http.Request) error
}

func (d *diagnostics) handle(pattern string, h http.Handler) {
	if pattern == "/healthz" {
		d.mu.Lock()
		d.healthz = h
		d.mu.Unlock()
		return
	}
	d.mux.Handle(pattern, h)
}

func (d *diagnostics) addCheck(name string, check func(r *http.Request) error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.checks = append(d.checks, healthCheck{name, check})
}

// serveHealthz answers ok while every check passes: the process serves HTTP, and what its
// Servers check of themselves holds.
func (d *diagnostics) serveHealthz(w http.ResponseWriter, r *http.Request) {
	d.mu.Lock()
	h, checks := d.healthz, slices.Clone(d.checks)
	d.mu.Unlock()
	if h != nil {
		h.ServeHTTP(w, r)
		return
	}
	for _, c := range checks {
		if err := c.check(r); err != nil {
			http.Error(w, fmt.Sprintf("%s: %v", c.name, err), http.StatusInternalServerError)
			return
		}
	}
	fmt.Fprint(w, "ok")
}

// serveHTTP starts the diagnostics server on addr and returns its mux and a function that
// stops it. gatherers are served on metricsPath: the core's registry, client-go's
// process-wide one (workqueue, leader election, Go runtime and process metrics) and the CSI
// call metrics.
func serveHTTP(ctx context.Context, addr, metricsPath string, pprofOn bool, gatherers prometheus.Gatherer, h *health) (*diagnostics, func(), error) {
	mux := http.NewServeMux()
	d := &diagnostics{mux: mux}
	mux.Handle(metricsPath, metrics.HandlerFor(gatherers, metrics.HandlerOpts{ErrorHandling: metrics.ContinueOnError}))
	mux.HandleFunc("/healthz", d.serveHealthz)
	mux.HandleFunc("/healthz/leader-election", h.leaderElection)
	mux.HandleFunc("/readyz", h.readyz)
	if pprofOn {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}

	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("listening on --http-endpoint %s: %w", addr, err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			klog.FromContext(ctx).Error(err, "HTTP server stopped", "address", addr)
		}
	}()
	klog.FromContext(ctx).Info("Serving diagnostics", "address", l.Addr().String(), "metricsPath", metricsPath)
	return d, func() { _ = srv.Close() }, nil
}
