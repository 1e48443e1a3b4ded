// Package lifecycle is the core every csi-sidecars sidecar runs on. It owns a sidecar
// process's whole life: the shared flags, the one signal handler, the kube clients and the
// shared informer factory, the CSI connection and its probe, leader election, the HTTP
// server (/metrics, /healthz, /healthz/leader-election, /readyz), the drain on shutdown and
// the exit code. It is the only package that knows about process lifetime.
//
// A sidecar implements Sidecar and never handles signals, Leases or os.Exit. The core keeps
// the promises of DESIGN.md for every sidecar it hosts:
//
//   - P1: the first SIGTERM/SIGINT cancels only the intake context handed to Sidecar.Run;
//     in-flight operations run on Env.Ops(), which the signal does not cancel.
//   - P2: once every Run has returned, the Lease is released (holder emptied) and the
//     process exits 0.
//   - P3: the drain is bounded by --drain-timeout; when it runs out Ops() is cancelled and
//     the Lease is kept, so it expires on its own while the driver finishes what it was told.
//   - P4: a standby exits 0 promptly on SIGTERM.
//   - P5: a second signal exits at once, non-zero.
//   - P6: losing the Lease while leading cancels Ops() and every CSI call at once (fencing)
//     and exits non-zero.
//   - P7: standbys start the informer factory before they lead and watch the Lease, so a
//     released or expired Lease is taken at once and work starts from warm caches.
//   - P8: all of the above is here, once.
//
// Acquiring the Lease is done here (watch-triggered, see lease.go) because client-go's
// LeaderElector only polls every retry period; holding, renewing and releasing it is left to
// client-go's LeaderElector with ReleaseOnCancel, with a guarded lock that lets the core
// refuse the release when the drain did not end cleanly.
//
// The package never imports a sidecar. One process may host several sidecars at once, each
// with its own Lease, sharing the signal handler, HTTP server, CSI connection and informer
// factory; nothing here is package-level mutable state.
package lifecycle
