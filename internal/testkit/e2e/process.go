package e2e

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Pid is the replica's process id.
func (r *Replica) Pid() int { return r.cmd.Process.Pid }

// PeakRSS is the replica's peak resident memory so far, in bytes: VmHWM of
// /proc/<pid>/status. It is 0 once the process has exited (or where /proc has no VmHWM),
// so read it before signalling a replica that is about to exit.
func (r *Replica) PeakRSS() int64 {
	if !r.Running() {
		return 0
	}
	return PeakRSS(r.Pid())
}

// PeakRSS is a process's peak resident memory (VmHWM) in bytes, 0 if unknown.
func PeakRSS(pid int) int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				return 0
			}
			return kb << 10
		}
	}
	return 0
}
