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
// No leaked volumes (upstream's issue 486): a provisioning that was started is always
// finished or undone, even after SIGKILL, because the claim says it was started.
//
//   - What: before the first CreateVolume of a claim, one update of the claim adds the
//     finalizer provisioner.csi-sidecars.io/provisioning-protection and the annotation
//     provisioner.csi-sidecars.io/provisioning, the record: driver, volume name, the
//     selected node, the provisioner secret's reference, and the CreateVolume request
//     without its secrets (record.go). The update carries the resource version (upstream's
//     RBAC grants update, not patch, on claims).
//   - Order of writes: record on the claim, then the source's protection finalizer, then
//     CreateVolume, then the PersistentVolume, then the record goes (one update). At every
//     moment either the claim's record or the PersistentVolume says the volume may exist,
//     and which secret deletes it: the PersistentVolume names its deletion secret, the
//     record the secret it was created with. The source's finalizer goes only once no
//     record names the claim: it outlives the volume's uncertainty.
//   - Who finishes or undoes it: whoever leads next, or this process on its next sync.
//     Claims carrying a record are queued like pending ones, so a new leader finds them all
//     in its warm caches. decideRecord (a table-tested function) says: a PersistentVolume
//     of the name exists: drop the record; the claim is gone, deleted, bound elsewhere,
//     names another provisioner, selects another node than the record (rescheduled), or
//     names its volume otherwise (flags changed): undo; else finish: CreateVolume again
//     (idempotent by name), the PersistentVolume, drop the record.
//   - Undo: ask the API server (not the cache) that no PersistentVolume records the name;
//     send the recorded CreateVolume again, which returns the volume's ID (or makes it, to
//     be deleted the same way); DeleteVolume; only then drop the record. A final error from
//     the driver says it has no such volume; AlreadyExists, timeouts and a failed
//     DeleteVolume keep the record and are retried with backoff. A process that saw the
//     outcome itself skips the calls: a claim deleted while its CreateVolume runs has its
//     volume deleted with the ID just returned, and one deleted after a final error loses
//     its record without another call.
//   - Secrets: the undo of this process's own plan uses the secrets it read for it. After a
//     restart the provisioner secret is read again when the undo runs: the one the
//     StorageClass names (the claim still exists, so its templates resolve), else, the
//     class being gone, the one the record names. An undo whose secret cannot be read does
//     not call the driver (an answer without credentials would say nothing about the
//     volume): the claim keeps its record with a ProvisioningUndoFailed event until the
//     secret is back. So delete a claim before the secret its class names, as for the
//     deletion secret of a PersistentVolume.
//   - Nothing blocks a user longer than the volume's uncertainty: a deleted claim goes as
//     soon as its volume is known deleted (ProvisioningUndone event); a driver that keeps
//     failing shows as ProvisioningUndoFailed events on the claim.
//   - Trust: the claim's owner can edit its annotations. A record whose volume name is not
//     made from the claim's UID is never acted on (ProvisioningRecordUntrusted event; an
//     administrator removes the finalizer), a finished volume is made from a fresh plan,
//     never from the recorded request, and the secret comes from the StorageClass while
//     there is one. An edited request can at worst make and delete a volume of the claim's
//     own name.
//   - Names: upstream has no such record (KEP-2994 was closed), and its claim finalizers
//     live under provisioner.storage.kubernetes.io: a name there could later be taken by
//     an upstream finalizer with other rules. Ours live under the project's domain, which
//     upstream treats as unknown.
//   - Rolling upgrade: a claim without a record is provisioned as before. Upstream leaves
//     our finalizer and annotation alone: a claim carrying them is provisioned and bound
//     by an upstream replica as any other, but a claim deleted while only upstream runs
//     stays Terminating until a csi-sidecars provisioner drops the record (it finds the
//     PersistentVolume, or undoes the volume). After a downgrade for good, remove the
//     finalizer from such claims by hand once their volumes are known.
//
// A CreateVolume that ends without a final answer (timeout, cancelled, unavailable,
// aborted) is retried with the same name, which CSI makes idempotent, until the driver
// answers for good; if the claim stops wanting the volume meanwhile, the retry is the
// undo's first step.
//
// Data sources: a claim cloning a claim or restoring a VolumeSnapshot gets its source
// checked as upstream checks it (datasource.go, pure) and protected by upstream's finalizer
// from before CreateVolume until no claim still needs it (sources.go: a third queue, and
// a periodic sweep for snapshot finalizers left behind). The plan is pending from before
// the finalizer goes on, so a claim deleted while its CreateVolume runs does not free the
// source mid-copy. A snapshot without a content (never bound, or the content gone) loses
// the finalizer once no claim of the driver uses it: nothing can restore from it. Other kinds are left to their
// populators. Cross-namespace sources are not implemented: enabling the gate is a usage
// error.
//
// Storage capacity tracking (--enable-capacity, capacity.go): one CSIStorageCapacity per
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
// deploy/kubernetes/rbac.yaml), so every API write uses a verb that file grants (rbac.go):
// PersistentVolumes are created, patched and deleted, never updated; claims (their record,
// the selected node) are updated, never patched. What some v6 release does not grant (watch and update on VolumeSnapshots
// before v6.2) degrades the feature it serves, with one warning, as upstream does, and
// never fails the work.
//
// CSI migration (migration.go): a driver that replaces an in-tree plugin (csi-translation-lib)
// provisions the claims of the plugin's StorageClasses that kube-controller-manager hands
// over, with the class translated, and records each volume as an in-tree
// PersistentVolume provisioned by the plugin, as upstream; it deletes such volumes with the
// translated handle.
//
// Not implemented: cross-namespace data sources.
package provisioner
