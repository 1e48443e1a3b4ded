// Package capacity is the provisioner's storage capacity tracking (--enable-capacity): one CSIStorageCapacity object per
// (topology segment of the driver, StorageClass of the driver), holding what GetCapacity
// answers for that pair, so that the scheduler places pods where their volumes fit.
//
// The shape is the provisioner's: informer handlers only enqueue; one queue of keys
// (class, segment) plus one key that recomputes the desired set from the listers; one sync
// per key that calls GetCapacity and writes the answer, both on Ops() (P1: a poll in
// flight when intake ends finishes and its write lands); a poll loop that re-enqueues every
// key each --capacity-poll-interval. Objects are recognised by upstream's labels (driver
// name, managed-by), so a new leader, or upstream's external-provisioner before it, keeps
// the objects it finds and deletes those nobody wants any more.
//
// Objects are read and written as every sidecar does (lifecycle's one way to write): from
// the cache read through this replica's own writes and creations (lifecycle.OwnWrites), an
// update carrying the copy's resourceVersion; a conflict goes back to the queue, whose
// backoff lets the cache catch up. OwnWrites also tells the events of its own writes from
// changes by someone else (Echo): only the latter ask for a sync.
//
// The provisioner builds a Tracker from its flags (Config), runs it beside its own
// queues, and tells it which capacity a provisioning or deletion changed (Refresh). The
// package knows nothing of claims or volumes: capacity.go is the tracker, owner.go the
// owner of its objects (--capacity-ownerref-level) and the managed-by label of a node
// deployment, metrics.go upstream's capacity metrics.
package capacity
