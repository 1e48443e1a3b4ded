package attacher

import "sync"

// forcedSyncs names VolumeAttachments the reconciler found out of step with the driver:
// their next sync calls the driver even though their status looks done. A name leaves at
// that sync, when the sync finds the VolumeAttachment gone, or at its deletion, so the set
// holds no more names than there are VolumeAttachments.
type forcedSyncs struct {
	mu    sync.Mutex
	names map[string]bool
}

func newForcedSyncs() *forcedSyncs { return &forcedSyncs{names: map[string]bool{}} }

// set forces the next sync of name.
func (f *forcedSyncs) set(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.names[name] = true
}

// has tells whether the next sync of name is forced, without consuming it.
func (f *forcedSyncs) has(name string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.names[name]
}

// consume tells whether the next sync of name is forced, and forgets it.
func (f *forcedSyncs) consume(name string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	forced := f.names[name]
	delete(f.names, name)
	return forced
}
