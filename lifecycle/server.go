package lifecycle

import (
	"context"
	"errors"
	"net/http"

	"github.com/spf13/pflag"
	"google.golang.org/grpc"
)

// Hosted is what every sidecar the core hosts has: a name (its subcommand) and flags. It is
// either a Sidecar, which works on API objects while it holds a Lease, or a Server, which
// answers requests on every replica and never leads.
type Hosted interface {
	// Name is the sidecar's subcommand, for example "attacher".
	Name() string
	// AddFlags registers the sidecar's own flags, with upstream names and defaults.
	AddFlags(fs *pflag.FlagSet)
}

// Server is a sidecar that does not lead: it answers requests of the kubelet (plugin
// registration, the driver container's liveness probe) on every replica, with no Lease and
// no API server. A process that hosts only Servers never reads a kubeconfig; the shared
// leader-election and API flags are accepted and mean nothing to it.
//
// The core's promises carry over where they apply: the first signal ends intake, and what
// the Server was doing (a call it answers, the CSI call behind it) finishes on Ops(), which
// only --drain-timeout cancels; the second signal exits at once. A Server that returns nil
// after intake ended exits 0. One that returns while intake is open, or returns an error,
// ends the process with ExitError, as its upstream sidecar exits 1 (the others drain),
// unless the error is ErrNothingToServe.
type Server interface {
	Hosted
	// Serve runs from start-up until intake ends, then returns once what it was doing has
	// ended. It may start answering before the driver does: env.CSI waits for the driver.
	Serve(intake context.Context, env *ServerEnv) error
}

// ErrNothingToServe is what Serve returns when its flags ask for no service at all (an
// upstream one-shot mode kept for old manifests): the process then exits 0 at once, the
// other sidecars draining first.
var ErrNothingToServe = errors.New("nothing to serve")

// ServerEnv is what the core hands a Server.
type ServerEnv struct {
	// CSI is the Server's connection to the driver. It is a connection of its own, dialled
	// until the driver listens and re-dialled when the driver restarts (a driver container
	// restarted by its liveness probe must not take its probe and its registration with
	// it). A call waits for the connection within its context, is counted as in flight, is
	// recorded in csi_sidecar_operations_seconds once the driver's name is known, and is
	// cancelled when Ops() is.
	CSI grpc.ClientConnInterface
	// CSIAddress is --csi-address.
	CSIAddress string
	// Alone is true when the process hosts this Server only (its subcommand): shared flags
	// then mean what its upstream sidecar's flags of the same name mean.
	Alone bool
	// HTTPEndpoint is --http-endpoint ("" when unset; the diagnostics server may then still
	// run on the deprecated --metrics-address).
	HTTPEndpoint string

	ops        context.Context
	driverName func(ctx context.Context) (string, error)
	diag       *diagnostics
}

// Ops is the parent context of what the Server is doing: the first signal does not cancel
// it, --drain-timeout does.
func (e *ServerEnv) Ops() context.Context { return e.ops }

// DriverName returns the name the driver reports in GetPluginInfo. The first caller waits
// until the driver answers, retrying with backoff and reporting each failure, until ctx
// ends; the name is then kept for the life of the process.
func (e *ServerEnv) DriverName(ctx context.Context) (string, error) { return e.driverName(ctx) }

// HandleDiagnostics serves h on pattern of the diagnostics server (--http-endpoint) and
// reports whether there is one. A Server that answers /healthz in its upstream sidecar's
// place (Alone) replaces the core's /healthz this way.
func (e *ServerEnv) HandleDiagnostics(pattern string, h http.Handler) bool {
	if e.diag == nil {
		return false
	}
	e.diag.handle(pattern, h)
	return true
}

// AddHealthCheck makes the diagnostics server's /healthz fail while check returns an
// error, with the check's name and error in the answer: the sidecar container's own
// liveness, for a Server that can tell it is stuck.
func (e *ServerEnv) AddHealthCheck(name string, check func(r *http.Request) error) {
	if e.diag != nil {
		e.diag.addCheck(name, check)
	}
}
