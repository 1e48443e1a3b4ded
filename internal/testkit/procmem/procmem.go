// Package procmem reads a process's resident memory from /proc/<pid>/status, as the
// benchmarks, the end-to-end harness and the demo report it.
package procmem

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Memory is a process's resident memory in bytes: the peak so far (VmHWM), now (VmRSS),
// and of now the anonymous part (heap, stacks, runtime: RssAnon) and the file-backed part
// (the binary's pages: RssFile).
type Memory struct{ Peak, Now, Anon, File int64 }

// Read reads process pid's memory. A field /proc does not give stays 0.
func Read(pid int) (Memory, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return Memory{}, fmt.Errorf("procmem: reading the memory of pid %d: %w", pid, err)
	}
	return parse(string(data)), nil
}

// parse reads the fields of Memory from the text of /proc/<pid>/status.
func parse(status string) Memory {
	var m Memory
	fields := map[string]*int64{"VmHWM": &m.Peak, "VmRSS": &m.Now, "RssAnon": &m.Anon, "RssFile": &m.File}
	for line := range strings.SplitSeq(status, "\n") {
		key, value, ok := strings.Cut(line, ":")
		if !ok || fields[key] == nil {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(value), "kB")), 10, 64)
		if err != nil {
			continue
		}
		*fields[key] = kb << 10
	}
	return m
}

// Peak is process pid's peak resident memory (VmHWM) in bytes, 0 if unknown (it has
// exited, or /proc has no VmHWM).
func Peak(pid int) int64 {
	m, err := Read(pid)
	if err != nil {
		return 0
	}
	return m.Peak
}
