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
// PersistentVolume, error classes) as plain functions tested by tables. Libraries still do
// what they do well: client-go, k8s.io/component-helpers (annotations, finalizer name,
// storage class and node-affinity helpers) and csi-lib-utils (access modes, sanitised
// logging of requests).
//
// Never give up on a volume that may exist: a CreateVolume that ends without a final answer
// (timeout, cancelled, unavailable, aborted) is retried with the same name, which CSI makes
// idempotent, until the driver answers for good, even if the claim is deleted meanwhile; the
// volume then gets its PersistentVolume like any other and is reclaimed from there.
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
// PersistentVolumes are created, patched and deleted, never updated; claims are updated,
// never patched. What some v6 release does not grant (watch and update on VolumeSnapshots
// before v6.2) degrades the feature it serves, with one warning, as upstream does, and
// never fails the work.
//
// Not implemented: CSI migration of in-tree volumes (claims and volumes of an in-tree
// plugin migrated to the driver are left alone: no finalizer is put on such a volume, as
// nothing here could delete it), and cross-namespace data sources.
package provisioner
