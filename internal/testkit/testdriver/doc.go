// Package testdriver is the project's own fake CSI driver. It stands in for a
// cloud storage backend in end-to-end tests and demos.
//
// The package owns three things:
//
//   - Backend: the in-memory storage system (volumes, where they are
//     published, free capacity, snapshots and group snapshots) shared by
//     every gRPC server of one driver, so that several sidecar replicas, each
//     on its own UNIX socket, see the same volumes.
//   - The CSI Identity, Controller, GroupController (volume group snapshots,
//     served along with CREATE_DELETE_SNAPSHOT) and a minimal Node service
//     that serve the Backend over UNIX sockets (Backend.Serve).
//   - The instruments tests use to judge sidecars: a journal of every call
//     with the ids, names and secret keys it carried (Backend.Journal,
//     Backend.WaitFor), an overlap detector for concurrent mutating
//     operations on one volume, snapshot or group snapshot
//     (Backend.Overlaps), per-method latency, injected errors that can be
//     changed while the driver runs, snapshots that become ready to use
//     only after a while or a number of status polls, and volume health
//     (ControllerGetVolumeHealth, ControllerListVolumeHealth of CSI spec v1.13+)
//     that tests set and change per volume (Backend.SetVolumeHealth).
//
// Like a cloud API, the Backend finishes an operation it has started even when
// the caller gives up: a mutating call starts a backend operation that sleeps
// the configured latency and then applies its effect; the gRPC handler returns
// early with Canceled or DeadlineExceeded if the caller's context ends first,
// but the operation still runs to its end. This is what lets tests catch a
// sidecar that retries, or starts the opposite operation, while the previous
// one is still running in the backend.
package testdriver
