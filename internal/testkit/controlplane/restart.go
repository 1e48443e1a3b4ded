package controlplane

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"time"
)

// StopAPIServer stops kube-apiserver the way a real restart would: SIGTERM,
// then a wait for its graceful shutdown (which ends open watches and closes
// connections), bounded at 30s before SIGKILL. etcd keeps running and the
// temporary directory, certificates and tokens stay, so StartAPIServer can
// bring the same apiserver back. Stopping a kube-apiserver that has already
// exited, or after Stop, is a no-op.
func (cp *ControlPlane) StopAPIServer() error {
	cp.mu.Lock()
	p := cp.apiserver
	cp.mu.Unlock()
	// Not under mu: the wait may take seconds, and Stop must be able to cut
	// it short by killing p.
	return p.terminate(apiserverStopGrace)
}

// StartAPIServer starts kube-apiserver again after StopAPIServer (or after it
// crashed) and returns once /readyz answers. It runs with exactly the first
// start's arguments: same URL, same etcd, so all objects are still there, and
// same --cert-dir. kube-apiserver generates a self-signed serving certificate
// into --cert-dir only when none is there, so it reuses the first one, and
// clients holding Config, KubeconfigPath or tokens keep working unchanged.
// Its output is appended to the same apiserver.log.
//
// The port is not changed even if another process took it meanwhile, since
// clients hold the URL; StartAPIServer then fails with an error saying so.
// ctx bounds the wait, as does Options.ReadyTimeout. It is an error to call
// StartAPIServer while kube-apiserver runs, or after Stop.
func (cp *ControlPlane) StartAPIServer(ctx context.Context) error {
	p, err := cp.startAPIServerAgain()
	if err != nil {
		return err
	}
	readyCtx, cancel := context.WithTimeout(ctx, cp.readyTimeout)
	defer cancel()
	// On failure, leave nothing half-started behind; p stays recorded as
	// exited, so a later StartAPIServer may try again.
	if err := cp.waitAPIServerReady(readyCtx, p); err != nil {
		_ = p.stop()
		cp.mu.Lock()
		stopped := cp.stopped
		cp.mu.Unlock()
		switch {
		case stopped:
			return fmt.Errorf("control plane: Stop was called while kube-apiserver started: %w", err)
		case errors.Is(err, errPortInUse):
			return fmt.Errorf("control plane: kube-apiserver cannot listen on %s again: another process took the port since it stopped, and it cannot move to another one because clients hold this URL: %w", cp.url, err)
		}
		return err // startError says what failed and where the log is
	}
	// /readyz was probed without verification; make sure the certificate
	// clients were given still verifies, which is the point of reusing it.
	if err := cp.checkServingCert(readyCtx); err != nil {
		_ = p.stop()
		return err
	}
	return nil
}

// startAPIServerAgain starts the kube-apiserver process for StartAPIServer.
func (cp *ControlPlane) startAPIServerAgain() (*process, error) {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	if cp.stopped {
		return nil, errors.New("control plane: start kube-apiserver: the control plane was stopped")
	}
	if p := cp.apiserver; p != nil {
		select {
		case <-p.done:
		default:
			return nil, fmt.Errorf("control plane: start kube-apiserver: it is still running (pid %d); call StopAPIServer first", p.pid)
		}
	}
	// Without the certificate kube-apiserver would quietly generate a new
	// one that no client trusts; fail with the actual reason instead.
	for _, name := range []string{"apiserver.crt", "apiserver.key"} {
		if _, err := os.Stat(filepath.Join(cp.dir, "certs", name)); err != nil {
			return nil, fmt.Errorf("control plane: start kube-apiserver: its serving certificate is gone: %w", err)
		}
	}
	// A marker between the runs, for whoever reads the log. Best effort.
	if f, err := os.OpenFile(filepath.Join(cp.logDir, "apiserver.log"), os.O_WRONLY|os.O_APPEND, 0); err == nil {
		fmt.Fprintf(f, "---- controlplane: starting kube-apiserver again at %s ----\n", time.Now().Format(time.RFC3339Nano))
		f.Close()
	}
	// Under mu, so that Stop either sees this process or prevents it.
	p, err := cp.startAPIServerProcess()
	if err != nil {
		return nil, err
	}
	cp.apiserver = p
	return p, nil
}

// startAPIServerProcess starts kube-apiserver with the first start's command
// line. The caller holds mu.
func (cp *ControlPlane) startAPIServerProcess() (*process, error) {
	return startProcess(cp.apiserverPath, filepath.Join(cp.logDir, "apiserver.log"), cp.apiserverArgs...)
}

// checkServingCert makes one request that verifies the serving certificate
// against caData, exactly as clients from Config do.
func (cp *ControlPlane) checkServingCert(ctx context.Context) error {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(cp.caData) {
		return errors.New("control plane: no certificate in the apiserver's CA data")
	}
	client := &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}},
	}
	defer client.CloseIdleConnections()
	if result := probeOnce(ctx, client, cp.url+"/readyz", cp.token); result != "" {
		return fmt.Errorf("control plane: kube-apiserver restarted but fails for clients that verify its original serving certificate: %s", result)
	}
	return nil
}

// RestartAPIServer is StopAPIServer followed by StartAPIServer: etcd and all
// stored objects survive, clients see their connections close and must
// reconnect, and watches end.
func (cp *ControlPlane) RestartAPIServer(ctx context.Context) error {
	if err := cp.StopAPIServer(); err != nil {
		return err
	}
	return cp.StartAPIServer(ctx)
}

// KillAPIServer SIGKILLs kube-apiserver, as a crash or an OOM kill would: no graceful
// shutdown, connections reset. StartAPIServer brings it back.
func (cp *ControlPlane) KillAPIServer() error {
	cp.mu.Lock()
	p := cp.apiserver
	cp.mu.Unlock()
	return p.stop()
}

// KillEtcd SIGKILLs etcd; its data stays, and StartEtcd brings it back. kube-apiserver
// keeps running and fails or hangs the requests that need etcd meanwhile.
func (cp *ControlPlane) KillEtcd() error {
	cp.mu.Lock()
	p := cp.etcd
	cp.mu.Unlock()
	return p.stop()
}

// StartEtcd starts etcd again after KillEtcd, with the first start's command line (same
// ports, same data), and returns once it answers /health.
func (cp *ControlPlane) StartEtcd(ctx context.Context) error {
	cp.mu.Lock()
	if cp.stopped {
		cp.mu.Unlock()
		return errors.New("control plane: start etcd: the control plane was stopped")
	}
	if p := cp.etcd; p != nil {
		select {
		case <-p.done:
		default:
			cp.mu.Unlock()
			return fmt.Errorf("control plane: start etcd: it is still running (pid %d); call KillEtcd first", p.pid)
		}
	}
	p, err := cp.startEtcdProcess()
	cp.mu.Unlock()
	if err != nil {
		return err
	}
	readyCtx, cancel := context.WithTimeout(ctx, cp.readyTimeout)
	defer cancel()
	if err := waitHTTP(readyCtx, &http.Client{Timeout: 2 * time.Second}, cp.etcdURL+"/health", "", p); err != nil {
		return cp.startError("etcd", p, err)
	}
	return nil
}

// startEtcdProcess starts etcd with the first start's command line and records it. The
// caller holds mu, or is Start before the control plane is shared.
func (cp *ControlPlane) startEtcdProcess() (*process, error) {
	p, err := startProcess(cp.etcdPath, filepath.Join(cp.logDir, "etcd.log"), cp.etcdArgs...)
	if err != nil {
		return nil, err
	}
	cp.etcd = p
	return p, nil
}

// etcdProcess is the latest etcd started.
func (cp *ControlPlane) etcdProcess() *process {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return cp.etcd
}
