package controlplane

import (
	"context"
	"crypto/tls"
	"net/http"
	"path/filepath"
	"time"
)

// Child is a process started the way etcd and kube-apiserver are, for other
// components that run next to the control plane (kube-controller-manager,
// kube-scheduler): in its own process group, SIGKILLed by the kernel if the
// test binary dies (Linux), stdout and stderr appended to a log file.
type Child struct{ p *process }

// StartChild starts path with args, appending its output to logPath.
func StartChild(path, logPath string, args ...string) (*Child, error) {
	p, err := startProcess(path, logPath, args...)
	if err != nil {
		return nil, err
	}
	return &Child{p: p}, nil
}

// Name is the base name of the binary.
func (c *Child) Name() string { return c.p.name }

// Pid is the child's process id.
func (c *Child) Pid() int { return c.p.pid }

// LogPath is the file the child's output is appended to.
func (c *Child) LogPath() string { return c.p.logPath }

// Done is closed once the child has exited and been waited for.
func (c *Child) Done() <-chan struct{} { return c.p.done }

// Err is the child's exit error (nil for exit 0); valid once Done is closed.
func (c *Child) Err() error { return c.p.waitErr }

// Stop SIGKILLs the child's process group and waits for it. Stopping a child
// that has exited is a no-op; so is a nil Child.
func (c *Child) Stop() error {
	if c == nil {
		return nil
	}
	return c.p.stop()
}

// Terminate sends SIGTERM and waits up to grace before falling back to Stop.
func (c *Child) Terminate(grace time.Duration) error {
	if c == nil {
		return nil
	}
	return c.p.terminate(grace)
}

// LogTail is the last n lines this child logged (not earlier runs appended to
// the same file), without klog info and warning lines when there is anything
// else.
func (c *Child) LogTail(n int) string { return tailLog(c.p.logPath, c.p.logOffset, n) }

// WaitHTTPS polls url, a health endpoint the child serves over https with a
// self-signed certificate (not verified), until it answers 200, ctx ends or
// the child exits; the error then says which, with the last answer.
func (c *Child) WaitHTTPS(ctx context.Context, url string) error {
	probe := &http.Client{
		Timeout:   2 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}, //nolint:gosec // loopback health probe of a child we started
	}
	defer probe.CloseIdleConnections()
	return waitHTTP(ctx, probe, url, "", c.p)
}

// ServiceAccountKeyPath is the PEM RSA private key kube-apiserver verifies
// ServiceAccount tokens with (and signs them with), for
// kube-controller-manager's --service-account-private-key-file. It is removed
// by Stop.
func (cp *ControlPlane) ServiceAccountKeyPath() string { return filepath.Join(cp.dir, "sa.key") }

// CAPath is a PEM file with the apiserver's serving certificate followed by
// the CA that signed it, for --root-ca-file flags. It is removed by Stop.
func (cp *ControlPlane) CAPath() string { return filepath.Join(cp.dir, "certs", "apiserver.crt") }
