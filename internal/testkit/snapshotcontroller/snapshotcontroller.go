// Package snapshotcontroller runs the real snapshot-controller of external-snapshotter
// (Version, built by hack/control-plane.sh into the control plane's assets folder) next to a
// test control plane, and installs the VolumeSnapshot and VolumeGroupSnapshot CRDs of that
// release (embedded copies, crd/), for the snapshotter sidecar's end-to-end tests.
//
// The snapshot-controller is the cluster-wide half of snapshotting: it binds VolumeSnapshots
// to VolumeSnapshotContents, creates the content of a dynamic VolumeSnapshot (from the
// bound PersistentVolume of its claim and its VolumeSnapshotClass) and copies the content's
// status to the snapshot. The csi-snapshotter sidecar, the code under test, is the half that
// calls the CSI driver and writes the content's status.
//
// Start runs it as a child process the way package cluster runs kube-controller-manager:
// the control plane's admin kubeconfig, leader election off, output appended to
// snapshot-controller.log in the log folder, SIGKILLed by Stop (and by the kernel if the test
// binary dies).
package snapshotcontroller

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
)

const (
	// Binary is the snapshot-controller's file name in the assets folder.
	Binary = "snapshot-controller"
	// Version is the external-snapshotter release hack/control-plane.sh builds it from
	// (pinned in hack/snapshot-controller/go.mod); the binary reports it with --version.
	Version = "v8.7.0"

	defaultReadyTimeout = 60 * time.Second
	startAttempts       = 3
	logTailLines        = 25
)

// Assets returns the control plane's assets folder after checking that it holds the
// snapshot-controller. The error names what is missing and says how to build it.
func Assets() (string, error) {
	dir, err := controlplane.Assets()
	if err != nil {
		return "", err
	}
	if err := checkBinary(dir); err != nil {
		return "", err
	}
	return dir, nil
}

func checkBinary(dir string) error {
	path := filepath.Join(dir, Binary)
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		err = fmt.Errorf("%s is missing", path)
	case err == nil && (fi.IsDir() || fi.Mode().Perm()&0o111 == 0):
		err = fmt.Errorf("%s is not an executable file", path)
	}
	if err != nil {
		return fmt.Errorf("snapshot-controller: %w; run `make testenv` (hack/control-plane.sh) to build snapshot-controller %s into %s",
			err, Version, dir)
	}
	return nil
}

// Options tunes Start. The zero value is ready to use.
type Options struct {
	// LogDir receives snapshot-controller.log (appended to). Default: the control plane's
	// LogDir.
	LogDir string
	// AssetsDir holds the binary. Default: Assets().
	AssetsDir string
	// Args are appended to the command line; a repeated flag overrides the default (the
	// last one wins), e.g. "--retry-interval-max=5m" for upstream's back-off.
	Args []string
	// SkipCRDs leaves the CRDs alone; by default Start installs them first (InstallCRDs),
	// without which the snapshot-controller exits after 30 s.
	SkipCRDs bool
	// ReadyTimeout bounds the wait for the process to serve. Default: 60s.
	ReadyTimeout time.Duration
}

// Controller is a running snapshot-controller. Its methods are safe for concurrent use.
type Controller struct {
	child    *controlplane.Child
	endpoint string // http://127.0.0.1:<port>, its --http-endpoint

	stopOnce sync.Once
	stopErr  error
}

// Start installs the CRDs (unless opts.SkipCRDs) and starts the snapshot-controller against
// cp with:
//
//	--kubeconfig=<cp's admin kubeconfig> --leader-election=false
//	--http-endpoint=127.0.0.1:<free port> --retry-interval-max=5s -v=4
//
// then opts.Args. It returns once the process serves /metrics, which it does only after it
// found the VolumeSnapshot CRDs (and the VolumeGroupSnapshot CRDs, or gave up on them: the
// group feature gate CSIVolumeGroupSnapshot is GA and on) and built its controller; its
// informers start right after, so objects created from then on (or before) are handled.
// ctx bounds the start. A failed Start has stopped the process; its error quotes the log.
func Start(ctx context.Context, cp *controlplane.ControlPlane, opts Options) (*Controller, error) {
	var err error
	if opts.AssetsDir == "" {
		if opts.AssetsDir, err = Assets(); err != nil {
			return nil, err
		}
	} else if err := checkBinary(opts.AssetsDir); err != nil {
		return nil, err
	}
	if opts.LogDir == "" {
		opts.LogDir = cp.LogDir()
	}
	if opts.ReadyTimeout <= 0 {
		opts.ReadyTimeout = defaultReadyTimeout
	}
	readyCtx, cancel := context.WithTimeout(ctx, opts.ReadyTimeout)
	defer cancel()
	if !opts.SkipCRDs {
		if err := InstallCRDs(readyCtx, cp.Config()); err != nil {
			return nil, err
		}
	}

	logPath := filepath.Join(opts.LogDir, Binary+".log")
	for range startAttempts {
		var port int
		if port, err = freePort(); err != nil {
			return nil, err
		}
		endpoint := "127.0.0.1:" + strconv.Itoa(port)
		args := []string{
			"--kubeconfig=" + cp.KubeconfigPath(),
			"--leader-election=false",
			"--http-endpoint=" + endpoint,
			// Upstream backs a failed sync off up to 5 min: a VolumeSnapshot created before
			// its claim is bound (by kube-controller-manager) would wait minutes, since a
			// claim's change does not requeue its snapshots. The same role as
			// kube-controller-manager's short --pvclaimbinder-sync-period in package cluster.
			"--retry-interval-max=5s",
			"-v=4",
		}
		var child *controlplane.Child
		child, err = controlplane.StartChild(filepath.Join(opts.AssetsDir, Binary), logPath, append(args, opts.Args...)...)
		if err != nil {
			return nil, fmt.Errorf("snapshot-controller: %w", err)
		}
		c := &Controller{child: child, endpoint: "http://" + endpoint}
		err = c.waitServing(readyCtx)
		if err == nil {
			return c, nil
		}
		_ = child.Stop()
		tail := child.LogTail(logTailLines)
		err = fmt.Errorf("snapshot-controller did not become ready: %w\nlog: %s\nlast lines (klog info and warnings omitted):\n%s", err, logPath, tail)
		if !strings.Contains(tail, "address already in use") || readyCtx.Err() != nil {
			break
		}
	}
	return nil, err
}

// waitServing polls /metrics until it answers 200, ctx ends or the process exits.
func (c *Controller) waitServing(ctx context.Context) error {
	client := &http.Client{Timeout: 2 * time.Second}
	defer client.CloseIdleConnections()
	url := c.endpoint + "/metrics"
	ticker := time.NewTicker(100 * time.Millisecond)
	defer ticker.Stop()
	last := "no answer yet"
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := client.Do(req)
		if err == nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = resp.Status
		} else if ctx.Err() == nil {
			last = err.Error()
		}
		select {
		case <-c.child.Done():
			return fmt.Errorf("exited before %s answered: %v", url, c.child.Err())
		case <-ctx.Done():
			return fmt.Errorf("%s not ready (last: %s): %w", url, last, ctx.Err())
		case <-ticker.C:
		}
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("snapshot-controller: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Child is the process, for its pid, log and exit.
func (c *Controller) Child() *controlplane.Child { return c.child }

// MetricsURL is the URL of its Prometheus metrics (snapshot_controller_operation_* and
// the work queues').
func (c *Controller) MetricsURL() string { return c.endpoint + "/metrics" }

// Running reports an error when the process has exited, with the tail of its log.
func (c *Controller) Running() error {
	select {
	case <-c.child.Done():
		return fmt.Errorf("snapshot-controller exited: %v; log %s ends:\n%s", c.child.Err(), c.child.LogPath(), c.child.LogTail(logTailLines))
	default:
		return nil
	}
}

// Diagnostics says where the log is, with its tail: what a failing test should print.
func (c *Controller) Diagnostics() string {
	return fmt.Sprintf("--- %s (pid %d), log %s, last lines (klog info and warnings omitted):\n%s\n",
		c.child.Name(), c.child.Pid(), c.child.LogPath(), c.child.LogTail(logTailLines))
}

// Stop SIGKILLs the process and waits for it. It leaves the CRDs and every object alone
// (nothing removes the finalizers it put on them any more). It is idempotent and a nil
// Controller is a no-op.
func (c *Controller) Stop() error {
	if c == nil {
		return nil
	}
	c.stopOnce.Do(func() { c.stopErr = c.child.Stop() })
	return c.stopErr
}
