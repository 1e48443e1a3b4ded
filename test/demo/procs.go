package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// replica is one sidecar process of the demo.
type replica struct {
	sidecar string
	name    string
	socket  string
	cmd     *exec.Cmd
	done    chan struct{}
	code    int
	exited  time.Time
}

// startReplica runs `csi-sidecars <sidecar>` as identity name on the driver endpoint,
// logging to logDir/<name>.log.
func startReplica(bin, sidecar, name, endpoint, kubeconfig, namespace, logDir string, extra ...string) (*replica, error) {
	args := append([]string{sidecar,
		"--csi-address=" + endpoint,
		"--kubeconfig=" + kubeconfig,
		"--leader-election",
		"--leader-election-namespace=" + namespace,
		"--leader-election-identity=" + name,
		"-v=2",
	}, extra...)
	log, err := os.Create(filepath.Join(logDir, name+".log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	// The demo's children die with it, even on SIGKILL.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	r := &replica{sidecar: sidecar, name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		r.exited = time.Now()
		r.code = cmd.ProcessState.ExitCode()
		log.Close()
		close(r.done)
	}()
	return r, nil
}

func (r *replica) running() bool {
	select {
	case <-r.done:
		return false
	default:
		return true
	}
}

func (r *replica) kill() {
	if r.running() {
		_ = r.cmd.Process.Kill()
		<-r.done
	}
}
