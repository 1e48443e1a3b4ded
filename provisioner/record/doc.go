// Package record is the provisioner's durable provisioning record (P13): what says that a
// volume may exist in the driver while no PersistentVolume says so, and which secret
// deletes it, so that whoever leads next finishes or undoes a provisioning that was
// started, even after SIGKILL.
//
// The package knows the record and where it lives, not what to do about it: the
// provisioner's claim controller decides, from a record it reads here, whether to finish,
// drop or undo. From the bottom up:
//
//   - record.go: the Record (driver, volume name, selected node, the provisioner secret's
//     reference, the data source, the CreateVolume request without its secrets), read from
//     and written to an annotation; the record an earlier version kept on the claim itself;
//   - decoded.go: each version of a record event decoded once, for the index, the handlers
//     and every claim's sync;
//   - writer.go: the eventWriter, which writes the events that keep records: records that
//     wait for the budget together share one event (a group commit), weighed so that the
//     API server accepts it;
//   - store.go: the Store, which keeps records in upstream's "Provisioning" events on the
//     claim, labelled with the driver and the claim's UID, watched by every replica: it
//     opens a record before CreateVolume, reads the open record of a claim, and closes it;
//   - lost.go: the records no event keeps (the API server refused the event, or it
//     disappeared while the record was open), kept in memory by every replica;
//   - close.go: the Closer, which writes the "ProvisioningSucceeded" event that closes a
//     record once its PersistentVolume is saved, off the provisioning's path, with its own
//     queue;
//   - rewrite.go: the Rewriter, which writes the records no event keeps again, off the
//     provisioning's path, with its own queue.
package record
