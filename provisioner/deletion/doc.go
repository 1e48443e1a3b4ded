// Package deletion is the provisioner's deletion of released volumes: it keeps the
// provisioner's finalizer on the driver's PersistentVolumes right and, once one is
// released with reclaim policy Delete, calls DeleteVolume, then deletes the
// PersistentVolume and lets it go, as upstream external-provisioner does.
//
// The Deleter owns its queue (by PersistentVolume name) and its memory of what this
// process did (lifecycle.OwnWrites: a PersistentVolume it let go is gone, a DeleteVolume
// that succeeded is a step taken), so that no sync repeats a DeleteVolume or the writes
// after it. The call and the writes run on Ops() (P1). The provisioner hands it plain
// values and funcs (Config); the claim's way never reaches it.
package deletion
