// Package snapshotter is the csi-sidecars snapshotter, the drop-in for csi-snapshotter v8.7
// (external-snapshotter's sidecar controller), hosted by the lifecycle core. It owns the
// VolumeSnapshotContents of one CSI driver, and its VolumeGroupSnapshotContents: it takes
// their snapshots (CreateSnapshot, CreateVolumeGroupSnapshot), records the result and its
// readiness on their status, checks pre-provisioned ones (ListSnapshots,
// GetVolumeGroupSnapshot) and deletes them by policy (DeleteSnapshot,
// DeleteVolumeGroupSnapshot) once upstream's snapshot-controller has agreed. Flags,
// defaults, annotations, finalizers, events, Lease and queue names are upstream's (P9).
//
// Every CSI call and the API writes that record its result run on the core's Ops()
// context, never on intake (P1): a SIGTERM lets them finish and be recorded. The writes
// that start work (the being-created record, the reads of secrets before a call) run on
// lifecycle.StartingWork, and a CSI call refused because intake ended is reported as
// nothing: the next leader takes the content from what was recorded.
//
// No snapshot the driver takes is left unrecorded: the content carries upstream's
// being-created annotation from before CreateSnapshot until its result is on the status
// (or the call failed for good), and a content with it is not deleted. Whoever leads next,
// after a crash or a handover, calls CreateSnapshot again with the same name (the driver
// answers with the same snapshot) and records it; a VolumeSnapshot deleted meanwhile has
// its snapshot deleted once it is recorded (upstream's issue 1388), from the queue, not from
// a watch event that may never come.
//
// Writes are patches of only what changes, from the cache read through this sidecar's own
// writes (lifecycle.OwnWrites), never from a GET made for the write; a deletion removes the
// finalizer in one write, and clears the status only when the content outlives it.
//
// It never handles signals, Leases or process exit, and keeps no package-level state.
package snapshotter
