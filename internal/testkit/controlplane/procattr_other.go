//go:build unix && !linux

package controlplane

import "syscall"

// sysProcAttr puts a child in its own process group so Stop can signal it
// and anything it spawns. There is no Pdeathsig outside Linux: children of a
// test binary that crashes must be killed by hand there.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
