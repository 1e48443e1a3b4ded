// Package provisioner is the csi-sidecars provisioner, the drop-in for upstream
// external-provisioner, hosted by the lifecycle core. It owns dynamic provisioning and
// deletion for one CSI driver: it watches PersistentVolumeClaims that name the driver,
// calls CreateVolume and records the result as a PersistentVolume; and it watches the
// driver's released PersistentVolumes with reclaim policy Delete, calls DeleteVolume and
// removes the PersistentVolume.
//
// It never handles signals, Leases or process exit (the core does, P8), and it never runs a
// CSI call, or the API write that records the call's result, on the intake context that a
// signal cancels: both run on Env.Ops() (P1).
//
// Why not sig-storage-lib-external-provisioner: that library derives the contexts of the
// CSI call and of the PersistentVolume write from its worker context, so stopping intake
// cancels a CreateVolume in flight, or lets it finish in the backend with no
// PersistentVolume to record it: a leaked volume. P1 needs the whole operation (CreateVolume
// AND the PersistentVolume) on a context the signal does not cancel, so the controller is
// written here, in the shape of sample-controller: a claim queue (keyed by claim UID, so a
// claim deleted while its volume may be in creation is still followed to a final answer) and
// a volume queue (keyed by PersistentVolume name), informer handlers that only enqueue, one
// sync function per object, and the decisions (names, parameters, secrets, topology, the
// PersistentVolume, error classes, what a provisioning record asks for) as plain functions
// tested by tables. Libraries still do what they do well: client-go,
// k8s.io/component-helpers (annotations, finalizer name, storage class and node-affinity
// helpers) and csi-lib-utils (access modes, sanitised logging of requests).
//
// Reading order. The provisioner is cut into parts that each own their state. The parts
// with a clear boundary are packages, so the compiler keeps every dependency running down:
//
//   - request: the pure parts of a request (names, sizes, capabilities, parameters,
//     secrets, topology, data source checks, CSI migration), tested by tables;
//   - record: the durable provisioning record, its store of events and its closer;
//   - sources: the data sources' protection, with its own queue, snapshot watch and sweep;
//   - deletion: the deletion of released volumes, with its own queue;
//   - capacity: storage capacity tracking (--enable-capacity), with its own queue;
//   - refgrant: the ReferenceGrants that let a claim use a data source of another
//     namespace (CrossNamespaceVolumeDataSource), with their own informer.
//
// This package holds the claim's way, which uses them all and which none of them uses.
// From the top down, each file uses only files listed after it:
//
//   - sidecar.go: the sidecar the core hosts (flags, Setup, Run); controller.go wires the
//     parts on the informer factory and runs their queues;
//   - claims.go: the claim's way: the handlers that queue a claim by UID, and syncClaim,
//     which reads top to bottom: an open record first (finish, drop or undo), then
//     whether the claim wants a volume, its plan, its record and its provisioning;
//   - provision.go: the claim's way's state (claimController) and its steps: CreateVolume
//     and what its answer means, the PersistentVolume, the record closed;
//   - undo.go: the undoer, which deletes a volume no claim wants and closes its record;
//   - create.go: the plans in flight and what a CreateVolume error means;
//   - crossns.go: which claims may use a data source of another namespace, and the
//     claims a grant's change wakes;
//   - plan.go: the planner, which reads what CreateVolume needs and writes nothing;
//     config.go: what every file here needs from the outside world;
//   - save.go (the PersistentVolume built from CreateVolume's answer), decide.go (does a
//     claim want a volume, what does its open record ask for), nodedeployment.go
//     (--node-deployment: localNode), vac.go;
//   - metrics.go, slowretry.go, flags.go: plain types and functions.
//
// No leaked volumes (upstream's issue 486): a provisioning that was started is always
// finished or undone, even after SIGKILL, because a durable record says it was started.
//
//   - What: before the first CreateVolume of a claim, upstream's "Provisioning" event on
//     the claim, written synchronously (not through the recorder) and labelled
//     provisioner.csi-sidecars.io/record=<driver> and .../claim-uid=<UID>, opens the
//     record; its annotation provisioner.csi-sidecars.io/provisioning holds it: driver,
//     volume name, the selected node, the provisioner secret's reference, the data source,
//     and the CreateVolume request without its secrets (package record).
//   - Order of writes: record opened, then the source's protection finalizer, then
//     CreateVolume, then the PersistentVolume, then upstream's "ProvisioningSucceeded"
//     event, which closes the record (its annotation names the events it closes). Three
//     writes, as upstream (P14): the claim itself is never written. Records that wait
//     together for the budget share one event (annotation
//     provisioner.csi-sidecars.io/provisioning-also, claims of the event's namespace only),
//     so under a backlog a provisioning costs little more than its PersistentVolume on the
//     way to a bound claim, and fewer writes than upstream in all. At every moment either
//     an open record or the PersistentVolume says the volume may exist, and which secret
//     deletes it. The source's finalizer goes only once no open record names it.
//   - Who finishes or undoes it: whoever leads next, or this process on its next sync.
//     Every replica watches the record events of its driver (a label selector), so a new
//     leader finds every open record in its warm caches, whether its claim is still there
//     or not. decideRecord (a table-tested function) says: a PersistentVolume of the name
//     exists: close the record; the claim is gone, deleted, bound elsewhere, names another
//     provisioner, selects another node than the record (rescheduled), or names its volume
//     otherwise (flags changed): undo; else finish: CreateVolume again (idempotent by
//     name), the PersistentVolume, close the record.
//   - Undo: ask the API server (not the cache) that no PersistentVolume records the name;
//     send the recorded CreateVolume again, which returns the volume's ID (or makes it, to
//     be deleted the same way); DeleteVolume; only then close the record, with a
//     ProvisioningUndone event. A final error from the driver says it has no such volume;
//     AlreadyExists, timeouts and a failed DeleteVolume keep the record open and are
//     retried with backoff. A process that saw the outcome itself skips the calls: a claim
//     deleted while its CreateVolume runs has its volume deleted with the ID just
//     returned, and one deleted after a final error has its record closed without another
//     call.
//   - How long: the API server keeps events for its --event-ttl (1 h by default). A record
//     still open while its CreateVolume keeps being retried is written again every 30
//     minutes; a record left by a crash is finished or undone as soon as a leader runs,
//     which must be within that hour.
//   - Secrets: the undo of this process's own plan uses the secrets it read for it. After a
//     restart the provisioner secret is read again when the undo runs: the one the
//     StorageClass names while the claim and its class are there (its templates resolve),
//     else the one the record names. An undo whose secret cannot be read does not call the
//     driver (an answer without credentials would say nothing about the volume): the record
//     stays open, with a ProvisioningUndoFailed event, until the secret is back.
//   - Nothing blocks a user: the claim carries no finalizer of ours and is deleted as
//     upstream's is; a driver that keeps failing an undo shows as ProvisioningUndoFailed
//     events on the claim.
//   - Trust: whoever may create events in the claim's namespace can write a record. One
//     whose volume name is not made from the claim's UID is never acted on
//     (ProvisioningRecordUntrusted event), a finished volume is made from a fresh plan,
//     never from the recorded request, and the secret comes from the StorageClass while
//     there is one. A forged record can at worst make and delete a volume of the claim's
//     own name that no PersistentVolume records.
//   - Earlier versions kept the record on the claim (finalizer
//     provisioner.csi-sidecars.io/provisioning-protection and the annotation). Such a
//     record is still read, and leaves the claim (one update) when it closes.
//   - Rolling upgrade with upstream: upstream ignores our labels and annotations; a claim
//     is provisioned by whichever leads. A record left open by a csi-sidecars leader while
//     only upstream runs is finished or undone once a csi-sidecars provisioner leads again
//     within the event TTL.
//
// A CreateVolume that ends without a final answer (timeout, cancelled, unavailable,
// aborted) is retried with the same name, which CSI makes idempotent, until the driver
// answers for good; if the claim stops wanting the volume meanwhile, the retry is the
// undo's first step.
//
// Data sources: a claim cloning a claim or restoring a VolumeSnapshot gets its source
// checked as upstream checks it (package request) and protected by upstream's finalizer
// from before CreateVolume until no claim still needs it (package sources: a third queue, and
// a periodic sweep for snapshot finalizers left behind). The plan is pending from before
// the finalizer goes on, so a claim deleted while its CreateVolume runs does not free the
// source mid-copy. A snapshot without a content (never bound, or the content gone) loses
// the finalizer once no claim of the driver uses it: nothing can restore from it. Other kinds are left to their
// populators. A source in another namespace (dataSourceRef.namespace, with the
// CrossNamespaceVolumeDataSource gate) is used only while a ReferenceGrant there allows
// it (package refgrant); its protection works as in the claim's own namespace, the users
// of a source being found by its namespace and key wherever they are. The grants never
// hold back a claim of its own namespace's source: a cluster without their CRD, or an RBAC
// without them, refuses only cross-namespace claims, saying what is missing.
//
// Storage capacity tracking (--enable-capacity, package capacity): one CSIStorageCapacity per
// (topology segment of the driver, StorageClass of the driver) from GetCapacity, in the
// namespace of NAMESPACE, owned per --capacity-ownerref-level, recognised by upstream's
// labels; its own queue, client and informer of the objects, and the same rule as the
// controllers: the GetCapacity and the write recording its answer run on Env.Ops() (P1).
// The events of its own writes ask for nothing: only an object someone else changed,
// removed or duplicated, or that is no longer wanted, is synced before the next poll (a
// drifting answer must not turn into a write stream). A provisioning or deletion refreshes
// the capacity it changed (the volume's segment of its class; the whole class after a
// failed provisioning) through a hook that only enqueues. The managed-by label of a node
// deployment is upstream's value, long node names shortened exactly as upstream does.
//
// RBAC: the provisioner runs with upstream's own (external-provisioner v6.x,
// deploy/kubernetes/rbac.yaml), so every API write uses a verb that file grants for its
// resource:
//
//	persistentvolumes       create, patch, delete  (never update)
//	persistentvolumeclaims  update                 (never patch: the selected node, an earlier version's record)
//	volumesnapshots         update                 (v6.2 on; v6.0 and v6.1 grant get, list only)
//	csistoragecapacities    create, update, patch, delete
//	events                  create, update, patch  (and list, watch: a leader reads the records back)
//	referencegrants         get, list, watch       (only with CrossNamespaceVolumeDataSource; upstream's file has the rule commented out)
//
// What upstream's RBAC of some v6 release does not grant degrades the feature it serves,
// with one warning in the log, as upstream does, and never fails the work: without update
// on volumesnapshots a restore goes on without source protection, without watch on them
// the snapshot cache is refreshed by relisting.
//
// CSI migration (package request): a driver that replaces an in-tree plugin (csi-translation-lib)
// provisions the claims of the plugin's StorageClasses that kube-controller-manager hands
// over, with the class translated, and records each volume as an in-tree
// PersistentVolume provisioned by the plugin, as upstream; it deletes such volumes with the
// translated handle.
package provisioner
