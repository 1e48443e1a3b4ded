// Package sources is the provisioner's protection of data sources: a claim cloning another
// claim, or restoring a VolumeSnapshot, has its source carry upstream's protection
// finalizer from before CreateVolume until no claim of the driver still needs it, so that
// the source is not deleted while a volume is made from it.
//
// The Guard owns its queue (by source key), the VolumeSnapshot watch and a periodic sweep
// for snapshot finalizers left behind (by a leader that stopped, or a claim deleted
// meanwhile). What "still needs" means is the claim's way's to say: the provisioner answers
// through Users, from its plans in flight and its open records. The finalizers are written
// on Ops() (P1): they belong to the operation they protect. Unlike upstream, which removes
// the cloning finalizer only once the source claim is being deleted, the finalizer goes as
// soon as no clone is in progress.
package sources
