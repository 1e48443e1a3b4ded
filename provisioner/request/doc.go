// Package request holds the pure parts of a provisioning, tested by tables: what the
// provisioner asks CreateVolume from a claim and its StorageClass, as upstream
// external-provisioner asks it. Nothing here reads a cache or writes to the API server
// (ReadSecret, the one read, is handed its client); the provisioner's planner gathers
// the objects and calls these.
//
//   - request.go: the volume's name (prefix and claim UID), size, file system, capabilities,
//     parameters and the extra metadata (--extra-create-metadata);
//   - secrets.go: the secrets a StorageClass names, their templates resolved as upstream's;
//   - topology.go: the accessibility requirement (requisite and preferred) and the node
//     affinity of the PersistentVolume;
//   - source_check.go: a claim's data source, a claim to clone or a snapshot to restore,
//     checked as upstream checks it;
//   - migration.go: CSI migration (csi-translation-lib): the names a claim, class or
//     PersistentVolume may give the driver, and the in-tree form of its volumes.
package request
