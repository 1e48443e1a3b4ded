// Package resizer is the csi-sidecars resizer, the drop-in for upstream external-resizer
// v2.3, hosted by the lifecycle core. It owns two controllers over the PersistentVolumeClaims
// of one CSI driver:
//
//   - expansion (expand.go): a bound PVC asking for more storage than it has gets
//     ControllerExpandVolume (or, for a driver that grows volumes only on the node, the
//     trivial hand-off to the kubelet), then the PV's capacity and the PVC's status are
//     recorded as upstream does: conditions, allocatedResources and
//     allocatedResourceStatuses, the recovery from an infeasible
//     request, the pre-resize-capacity and node-expansion-not-required annotations, events.
//     An in-tree PV whose plugin is migrated to the driver (CSI migration, csi-translation-lib)
//     is expanded with the translated volume handle once kube-controller-manager names the
//     driver in the PVC's storage-resizer annotation; the PV keeps its in-tree source.
//   - modification (modify.go): a PVC whose spec.volumeAttributesClassName differs from its
//     status gets ControllerModifyVolume with the class's parameters (and the secret the
//     PV's controller-modify-secret annotations name), and status.modifyVolumeStatus,
//     status.currentVolumeAttributesClassName and the PV's class are recorded. As upstream
//     (pkg/modifycontroller), a modification whose outcome is unknown (a call cut off,
//     timed out or refused as busy, or one a previous leader left InProgress: a new leader
//     has no record of how it ended) is finished with its own class before a new class or a
//     rollback is applied, so the class recorded is the one the volume has; a failed change
//     can be rolled back, which applies the current class again; and one the user withdraws
//     (class cleared) is carried on while InProgress, and marked cancelled
//     (VolumeModifyCanceled) otherwise.
//
// Every CSI call and the API writes that record its outcome run on the core's Ops() context,
// never on intake, so a SIGTERM lets them finish and be recorded (P1).
//
// Where it differs from upstream, it writes less to the API server and never changes what a
// user observes: a status patch whose result equals the current object is not sent (upstream
// re-patches the same status, with a new lastTransitionTime, on every retry), an unchanged
// condition keeps its lastTransitionTime, the error condition and the Infeasible status of a
// failed modification go in one patch instead of two, and a PVC that failed because a Pod
// uses it (offline-only driver) is retried when that Pod goes away instead of on a backoff
// timer that writes an event on every attempt. One event upstream does not write: a
// modification that fails before the driver is called (its secret cannot be read) records
// VolumeModifyFailed, because nothing in the status says why the PVC stays InProgress.
//
// Both controllers read PVCs and PVs through their own writes (lifecycle.OwnWrites, a
// mutation cache over the shared informers' stores): a sync that comes before the informer shows what the
// last sync wrote starts from the written object, so a stale copy never calls the driver
// again. The shared informer stores are never written to. A periodic resync re-runs a PVC
// whose work is due, never one waiting for its backoff, and costs no call, write or event
// when there is nothing to do. A write that records a ControllerExpandVolume that succeeded
// can still fail (someone else wrote the PVC meanwhile, and the resourceVersion that guards
// the status write no longer matches): its retry records what the driver answered then,
// without calling it again.
//
// The package never handles signals, Leases or process exit, and holds no package-level
// mutable state.
package resizer
