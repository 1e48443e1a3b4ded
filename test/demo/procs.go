package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"time"
)

// replica is one sidecar process of the demo.
type replica struct {
	sidecar string // what it runs: a sidecar's name, or "combined"
	name    string
	socket  string
	cmd     *exec.Cmd
	done    chan struct{}
	code    int
	exited  time.Time
}

// startReplica runs `csi-sidecars <args>` (a subcommand or --controllers, and the sidecars'
// own flags) as identity name on the driver endpoint, logging to logDir/<name>.log.
func startReplica(bin string, args []string, name, endpoint, kubeconfig, namespace, logDir string) (*replica, error) {
	args = append(slices.Clone(args),
		"--csi-address="+endpoint,
		"--kubeconfig="+kubeconfig,
		"--leader-election",
		"--leader-election-namespace="+namespace,
		"--leader-election-identity="+name,
		"-v=2",
	)
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
	r := &replica{name: name, cmd: cmd, done: make(chan struct{})}
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
