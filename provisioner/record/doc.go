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
//   - store.go: the Store, which keeps records in upstream's "Provisioning" events on the
//     claim, labelled with the driver and the claim's UID, watched by every replica: it
//     opens a record before CreateVolume (records that wait together for the budget share
//     one event), reads the open record of a claim, and closes it;
//   - close.go: the Closer, which writes the "ProvisioningSucceeded" event that closes a
//     record once its PersistentVolume is saved, off the provisioning's path, with its own
//     queue.
package record
