package controlplane

import "syscall"

// sysProcAttr puts a child in its own process group, so Stop can signal it
// and anything it spawns, and so a terminal's Ctrl-C reaches only the test
// binary; and asks the kernel to SIGKILL it when its parent thread dies, so a
// crashed or killed test binary never leaves an apiserver or etcd behind.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
