package e2e

import "github.com/csi-sidecars/csi-sidecars/internal/testkit/procmem"

// Pid is the replica's process id.
func (r *Replica) Pid() int { return r.cmd.Process.Pid }

// PeakRSS is the replica's peak resident memory so far, in bytes: VmHWM of
// /proc/<pid>/status. It is 0 once the process has exited (or where /proc has no VmHWM),
// so read it before signalling a replica that is about to exit.
func (r *Replica) PeakRSS() int64 {
	if !r.Running() {
		return 0
	}
	return procmem.Peak(r.Pid())
}
