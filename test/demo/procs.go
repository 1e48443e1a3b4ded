package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"
)

// replica is one sidecar process of the demo.
type replica struct {
	sidecar string // what it runs: a sidecar's name, or "combined"
	name    string
	socket  string
	readyz  string // URL of its /readyz
	probe   string // URL of the /healthz of the livenessprobe it hosts, if any
	cmd     *exec.Cmd
	started time.Time
	done    chan struct{}
	code    int
	exited  time.Time
}

// startReplica runs `csi-sidecars <args>` (a subcommand or --controllers, and the sidecars'
// own flags) as identity name on the driver endpoint, with leader election in namespace;
// see startProcess for probe.
func startReplica(bin string, args []string, name, endpoint, kubeconfig, namespace, logDir string, probe bool) (*replica, error) {
	return startProcess(bin, append(slices.Clone(args),
		"--csi-address="+endpoint,
		"--kubeconfig="+kubeconfig,
		"--leader-election",
		"--leader-election-namespace="+namespace,
		"--leader-election-identity="+name,
	), name, logDir, probe)
}

// startProcess runs `csi-sidecars <args>` as name with its diagnostics server on a free
// loopback port, logging to logDir/<name>.log. With probe, the process hosts the
// livenessprobe in combined mode, which gets a free port of its own
// (--livenessprobe-health-port).
func startProcess(bin string, args []string, name, logDir string, probe bool) (*replica, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	args = append(slices.Clone(args), "--http-endpoint=127.0.0.1:"+port, "-v=2")
	probeURL := ""
	if probe {
		probePort, err := freePort()
		if err != nil {
			return nil, err
		}
		args = append(args, "--livenessprobe-health-port="+probePort)
		probeURL = "http://127.0.0.1:" + probePort + "/healthz"
	}
	log, err := os.Create(filepath.Join(logDir, name+".log"))
	if err != nil {
		return nil, fmt.Errorf("log of %s: %w", name, err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	// The demo's children die with it, even on SIGKILL.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	r := &replica{name: name, readyz: "http://127.0.0.1:" + port + "/readyz", probe: probeURL, cmd: cmd, started: time.Now(), done: make(chan struct{})}
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

// waitReady waits until the replica's /readyz says ready (want: connected to its driver,
// caches synced) or not (!want: it stopped taking work, as it does first on SIGTERM), or
// until it exits, or ctx ends. The readiness endpoint is what a kubelet would probe; it has
// no cheaper signal, so it is polled.
func (r *replica) waitReady(ctx context.Context, want bool) error {
	client := &http.Client{Timeout: time.Second}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		resp, err := client.Get(r.readyz)
		if err == nil {
			resp.Body.Close()
			if (resp.StatusCode == http.StatusOK) == want {
				return nil
			}
		}
		select {
		case <-r.done:
			if want {
				return fmt.Errorf("%s exited with %d before it was ready", r.name, r.code)
			}
			return nil
		case <-ctx.Done():
			return fmt.Errorf("waiting until %s's /readyz says ready=%v: %w", r.name, want, ctx.Err())
		case <-tick.C:
		}
	}
}

func freePort() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return strconv.Itoa(l.Addr().(*net.TCPAddr).Port), nil
}

// waitProbe waits until the replica's livenessprobe answers 200 (the driver answered its
// Probe), or the replica exits, or ctx ends; it returns the last status code. The kubelet
// polls the probe too.
func (r *replica) waitProbe(ctx context.Context) (int, error) {
	client := &http.Client{Timeout: time.Second}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	code := 0
	for {
		resp, err := client.Get(r.probe)
		if err == nil {
			resp.Body.Close()
			if code = resp.StatusCode; code == http.StatusOK {
				return code, nil
			}
		}
		select {
		case <-r.done:
			return code, fmt.Errorf("%s exited with %d before its livenessprobe answered 200", r.name, r.code)
		case <-ctx.Done():
			return code, fmt.Errorf("waiting until %s's livenessprobe (%s) answers 200: %w (last: %d, %v)", r.name, r.probe, ctx.Err(), code, err)
		case <-tick.C:
		}
	}
}
