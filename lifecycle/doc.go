// Package lifecycle is the core every csi-sidecars sidecar runs on. It owns a sidecar
// process's whole life: the shared flags, the one signal handler, the kube clients and the
// shared informer factory, the CSI connection and its probe, leader election, the HTTP
// server (/metrics, /healthz, /healthz/leader-election, /readyz), the drain on shutdown and
// the exit code. It is the only package that knows about process lifetime.
//
// A sidecar implements Sidecar and never handles signals, Leases or os.Exit. The core keeps
// these promises for every sidecar it hosts (docs/promises.md states them for users):
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
//   - P10: a term writes only its own record (this identity and the acquire time it wrote).
//     A record of the same identity left by an earlier process, a container restarted in
//     the same pod, is another holder's: it is taken only once released or seen unrenewed
//     for a lease duration.
//   - P11: a leader fences itself renew-deadline after the start of its last successful
//     renewal, which Options.Validate makes strictly earlier than a standby that saw that
//     renewal may take the Lease; only the ending of a term that left nothing running in
//     the driver empties the holder (lease.TermLock.Release), never client-go's
//     release-on-cancel.
//   - P14: each hosted sidecar's clients draw from one budget (lifecycle/budget) that lets
//     a request wait for its token as long as its context lives and serves requests that
//     finish work before the event recorder's, and those before requests that start work
//     (StartingWork); from the end of intake on no new CSI call starts, so a drain waits
//     only for the calls in the driver and their writes.
//
// How a replica ends (each way is a row: drained, fenced, a drain deadline with or without
// calls in the driver, the driver lost, a standby stopping...) and what that means for the
// exit code and the Lease is decided in one table, endings in member.go, which docs/promises.md
// shows (a test keeps the two equal); nothing else sets an exit code or releases a Lease.
// When one of several hosted sidecars ends on its own, the process stops: the others drain
// and release, and the exit code is the worst of them.
//
// Acquiring the Lease is done here (watch-triggered, see lifecycle/lease) because
// client-go's LeaderElector only polls every retry period and trusts any record of its own
// identity; renewing it is left to client-go's LeaderElector, through a lease.TermLock that
// times the renewals and refuses every write once the term is over.
//
// What sidecars share beyond the process: the informer caches, whose transform
// (NewCacheTransform) drops what no sidecar reads and holds repeated strings and equal maps
// once (cached objects are read-only); one way to build a queue (NewQueue); and one way to
// read a cache through a sidecar's own writes and creations (OwnWrites, NewOwnCreations).
//
// One way to write (P14): a sidecar writes an object from the freshest copy it knows, the
// cache read through OwnWrites, never from a GET made for the write; an update carries that
// copy's resourceVersion (a patch, where the RBAC grants one, carries only what changes),
// and the answer goes back into OwnWrites. A conflict is returned to the queue, whose
// backoff lets the cache catch up before the object is decided again: a retry loop of
// GET and write would spend the budget twice per attempt on a contended object. A write
// that starts work runs on StartingWork; one that records a result or removes a finalizer
// on Ops().
//
// The parts (lifecycle/layout_test.go states what each may import). Package lifecycle holds
// the process: flags, signals, the HTTP server, the CSI connection, the hosting of Servers
// (server.go, serve.go) and of leading sidecars (member.go: their terms and the endings
// table), and what sidecars share (queues, OwnWrites, secrets). What only leading sidecars
// need is in parts below it, which the Server path never uses:
//
//   - lifecycle/lease: the Lease's watch, the acquire, the term's lock and renewal timing.
//   - lifecycle/budget: the API budget with its classes, the clients' transport that waits
//     for it and is measured, and the event broadcaster.
//   - lifecycle/outage: lists and watches that wait out API server outages, and whether the
//     caches are current again.
//   - lifecycle/cached: the informer caches' transform (CachedPod, shared strings and maps).
//
// lifecycle keeps the names sidecars use of them (StartingWork, Deferrable, TrimForCache,
// NewCacheTransform, CachedPod) as thin wrappers.
//
// The package never imports a sidecar. One process may host several sidecars at once, each
// with its own Lease, sharing the signal handler, HTTP server, CSI connection and informer
// factory; nothing here is package-level mutable state.
package lifecycle
