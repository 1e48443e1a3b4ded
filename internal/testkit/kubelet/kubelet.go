// Package kubelet runs a real kubelet next to a test control plane: hollow-kubelet, built by
// hack/control-plane.sh, which is the kubelet's own code started through kubemark's hollow
// node, with a fake container runtime and image service in place of containerd. No
// container ever runs, but the kubelet registers and heartbeats its Node, keeps its
// CSINode, and its plugin manager watches <root>/plugins_registry and registers the CSI
// drivers whose registration sockets appear there, as on a real node. That is what
// end-to-end tests of node-driver-registrar need.
//
// Start runs one kubelet as a child process (see controlplane.StartChild) for a test, Run
// for a program that is not one (the demo), with its own root directory, short enough for UNIX socket paths below it, and a Node name of its own, so
// that several test packages can each run kubelets at once. The kubelet only needs
// kube-apiserver: the node Lease goes to kube-node-lease, which the apiserver creates, and
// CSINode is a built-in API. Start and Restart return once the new process has reported
// the Node Ready. WatchDriver follows one driver in a node's CSINode: when it is listed, and
// each interval it was missing.
package kubelet

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
)

// Binary is the program Start runs, built next to kube-apiserver by hack/control-plane.sh.
const Binary = "hollow-kubelet"

const (
	defaultReadyTimeout = 90 * time.Second
	// stopGrace bounds the wait for a SIGTERMed kubelet before it is killed.
	stopGrace = 15 * time.Second
	// cleanupTimeout bounds the deletion of the Node and CSINode at cleanup.
	cleanupTimeout = 10 * time.Second
	pollInterval   = 200 * time.Millisecond
	logTailLines   = 60
)

// Options tunes Start. The zero value is ready to use.
type Options struct {
	// NodeName is the Node the kubelet registers. Default: "kubelet-" and random hex, so
	// that tests sharing a control plane never meet.
	NodeName string
	// AssetsDir holds hollow-kubelet. Default: Assets().
	AssetsDir string
	// Args are appended to hollow-kubelet's command line, e.g. "-v=4", or "--probes" for
	// the kubelet's own prober (kubemark's runs no probe and reports every container
	// ready).
	Args []string
	// ReadyTimeout bounds the wait for the Node to be Ready, at Start and Restart.
	// Default: 90s.
	ReadyTimeout time.Duration
	// LogDir receives kubelet-<node>.log. Default: the test's temporary directory (Start);
	// Run needs it.
	LogDir string
}

// Assets returns the folder holding hollow-kubelet: the control plane's assets folder. The
// error names what is missing and says how to build it.
func Assets() (string, error) {
	dir, err := controlplane.Assets()
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, Binary)
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		err = fmt.Errorf("%s is missing", path)
	case err == nil && (fi.IsDir() || fi.Mode().Perm()&0o111 == 0):
		err = fmt.Errorf("%s is not an executable file", path)
	}
	if err != nil {
		return "", fmt.Errorf("kubelet: %w; run `make testenv` (hack/control-plane.sh) to build %s %s into %s",
			err, Binary, controlplane.KubernetesVersion, dir)
	}
	return dir, nil
}

// Kubelet is a running (or stopped, between Stop and Restart) hollow kubelet. Its methods
// are safe for concurrent use.
type Kubelet struct {
	node         string
	root         string
	path         string
	args         []string
	logPath      string
	readyTimeout time.Duration
	kube         kubernetes.Interface

	mu    sync.Mutex
	child *controlplane.Child // the latest started, possibly exited
}

// Start runs a kubelet for opts.NodeName against cp and returns once its Node is Ready. Its
// root directory is a fresh folder under os.TempDir (short, for UNIX sockets), its log a
// file in opts.LogDir or else t's temporary directory, quoted when t fails. At cleanup the
// kubelet is killed, its root directory removed and its Node and CSINode deleted. Any
// failure fails t.
func Start(ctx context.Context, t testing.TB, cp *controlplane.ControlPlane, opts Options) *Kubelet {
	t.Helper()
	if opts.LogDir == "" {
		opts.LogDir = t.TempDir()
	}
	k, err := Run(ctx, cp, opts)
	if k != nil {
		t.Cleanup(func() {
			if child := k.Process(); child != nil && t.Failed() {
				t.Logf("kubelet %s (pid %d) last log lines:\n%s", k.node, child.Pid(), child.LogTail(logTailLines))
			}
			stopErr, deleteErr := k.close()
			if stopErr != nil {
				t.Error(stopErr)
			}
			if deleteErr != nil {
				t.Log(deleteErr)
			}
		})
	}
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// Run is Start for a program that is not a test: it needs opts.LogDir, returns its
// failures, and leaves the cleanup to Close. When the kubelet started but its Node did not
// become Ready, Run returns the Kubelet with the error, to be closed too.
func Run(ctx context.Context, cp *controlplane.ControlPlane, opts Options) (*Kubelet, error) {
	if opts.LogDir == "" {
		return nil, errors.New("kubelet: Run needs Options.LogDir")
	}
	assets := opts.AssetsDir
	if assets == "" {
		var err error
		if assets, err = Assets(); err != nil {
			return nil, err
		}
	}
	if opts.NodeName == "" {
		opts.NodeName = "kubelet-" + randomHex(4)
	}
	if opts.ReadyTimeout <= 0 {
		opts.ReadyTimeout = defaultReadyTimeout
	}
	kube, err := kubernetes.NewForConfig(cp.Config())
	if err != nil {
		return nil, fmt.Errorf("kubelet: client: %w", err)
	}
	// A short root: the registrar's socket goes to
	// <root>/plugins_registry/<driver>-reg.sock, within UNIX's 108 bytes.
	root, err := os.MkdirTemp("", "kl")
	if err != nil {
		return nil, fmt.Errorf("kubelet: root dir: %w", err)
	}
	k := &Kubelet{
		node:    opts.NodeName,
		root:    root,
		path:    filepath.Join(assets, Binary),
		logPath: filepath.Join(opts.LogDir, "kubelet-"+opts.NodeName+".log"),
		args: append([]string{
			"--kubeconfig=" + cp.KubeconfigPath(),
			"--node-name=" + opts.NodeName,
			"--root-dir=" + root,
			"--node-ip=127.0.0.1",
			// Any free port for the kubelet's API, none for the read-only one: several
			// kubelets run on this machine at once.
			"--port=0",
			"--read-only-port=0",
		}, opts.Args...),
		readyTimeout: opts.ReadyTimeout,
		kube:         kube,
	}
	return k, k.run(ctx)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // never fails
	return hex.EncodeToString(b)
}

// run starts the process and waits for it to report the Node Ready.
func (k *Kubelet) run(ctx context.Context) error {
	// A Node left Ready by an earlier process must not pass for this one's: mark it
	// Unknown first, as the node lifecycle controller does for a silent kubelet, so that
	// only the new process can make it Ready again. (A new kubelet renews an existing node
	// Lease at once, but creates a missing one only after a renew interval, 10s: the Lease
	// cannot tell.)
	if err := k.markNotReady(ctx); err != nil {
		return err
	}
	child, err := controlplane.StartChild(k.path, k.logPath, k.args...)
	if err != nil {
		return fmt.Errorf("kubelet %s: %w", k.node, err)
	}
	k.mu.Lock()
	k.child = child
	k.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, k.readyTimeout)
	defer cancel()
	if err := k.waitReady(ctx, child); err != nil {
		_ = child.Stop()
		return fmt.Errorf("kubelet %s: %w; last log lines:\n%s", k.node, err, child.LogTail(logTailLines))
	}
	return nil
}

// markNotReady sets the Node's Ready condition to Unknown, if the Node exists.
func (k *Kubelet) markNotReady(ctx context.Context) error {
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := k.kube.CoreV1().Nodes().Get(ctx, k.node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for i, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				node.Status.Conditions[i].Status = corev1.ConditionUnknown
				node.Status.Conditions[i].Reason = "KubeletStopped"
				node.Status.Conditions[i].Message = "the test kit restarts the kubelet"
				node.Status.Conditions[i].LastTransitionTime = metav1.Now()
			}
		}
		_, err = k.kube.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("kubelet %s: mark the Node not Ready: %w", k.node, err)
	}
	return nil
}

// waitReady polls the Node until its Ready condition is True, ctx ends or the child exits.
func (k *Kubelet) waitReady(ctx context.Context, child *controlplane.Child) error {
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		last := k.readiness(ctx)
		if last == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("node not Ready: %w (last: %s)", ctx.Err(), last)
		case <-child.Done():
			return fmt.Errorf("hollow-kubelet exited before its node was Ready: %v", child.Err())
		case <-tick.C:
		}
	}
}

// readiness says why the Node is not Ready; "" when it is.
func (k *Kubelet) readiness(ctx context.Context) string {
	node, err := k.kube.CoreV1().Nodes().Get(ctx, k.node, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return "Node not found"
	case err != nil:
		return "Node: " + err.Error()
	}
	for _, c := range node.Status.Conditions {
		if c.Type != corev1.NodeReady {
			continue
		}
		if c.Status == corev1.ConditionTrue {
			return ""
		}
		return fmt.Sprintf("Ready=%s (%s: %s)", c.Status, c.Reason, c.Message)
	}
	return "Node has no Ready condition"
}

// NodeName is the Node the kubelet registered.
func (k *Kubelet) NodeName() string { return k.node }

// RootDir is the kubelet's root directory; it survives Stop, Kill and Restart.
func (k *Kubelet) RootDir() string { return k.root }

// RegistrationDir is the folder the kubelet's plugin watcher watches for registration
// sockets (node-driver-registrar's --kubelet-registration-path goes below it).
func (k *Kubelet) RegistrationDir() string { return filepath.Join(k.root, "plugins_registry") }

// PluginsDir is where CSI drivers put their sockets, as <PluginsDir>/<driver>/csi.sock.
func (k *Kubelet) PluginsDir() string { return filepath.Join(k.root, "plugins") }

// LogPath is the file the kubelet logs to, every run appended.
func (k *Kubelet) LogPath() string { return k.logPath }

// Process is the latest kubelet process started.
func (k *Kubelet) Process() *controlplane.Child {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.child
}

// Stop sends SIGTERM to the kubelet and waits for it to exit (killing it after 15s).
// Stopping a stopped kubelet is a no-op.
func (k *Kubelet) Stop() error {
	if err := k.Process().Terminate(stopGrace); err != nil {
		return fmt.Errorf("kubelet %s: stop: %w", k.node, err)
	}
	return nil
}

// Kill SIGKILLs the kubelet and waits for it, as a crash would end it: nothing in its root
// directory is cleaned up.
func (k *Kubelet) Kill() error {
	if err := k.Process().Stop(); err != nil {
		return fmt.Errorf("kubelet %s: kill: %w", k.node, err)
	}
	return nil
}

// Restart stops the kubelet if it runs (SIGTERM), starts it again with the same root
// directory, node name and flags, and returns once the new process has reported the Node
// Ready.
func (k *Kubelet) Restart(ctx context.Context) error {
	if err := k.Stop(); err != nil {
		return err
	}
	return k.run(ctx)
}

// Close kills the kubelet, removes its root directory and deletes its Node, CSINode and
// node Lease, which nothing else collects on a test control plane. It returns what failed.
func (k *Kubelet) Close() error {
	stopErr, deleteErr := k.close()
	return errors.Join(stopErr, deleteErr)
}

// close is Close's work; stopErr says what failed of the process and its root directory,
// deleteErr what failed of the API objects (the control plane may be gone already).
func (k *Kubelet) close() (stopErr, deleteErr error) {
	var stopErrs, deleteErrs []error
	if child := k.Process(); child != nil {
		if err := child.Stop(); err != nil {
			stopErrs = append(stopErrs, fmt.Errorf("kubelet %s: %w", k.node, err))
		}
	}
	if err := os.RemoveAll(k.root); err != nil {
		stopErrs = append(stopErrs, fmt.Errorf("kubelet %s: remove root dir: %w", k.node, err))
	}
	// Delete what the kubelet created, so a shared control plane is left as found.
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	if err := k.kube.StorageV1().CSINodes().Delete(ctx, k.node, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		deleteErrs = append(deleteErrs, fmt.Errorf("kubelet %s: delete CSINode: %w", k.node, err))
	}
	if err := k.kube.CoreV1().Nodes().Delete(ctx, k.node, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		deleteErrs = append(deleteErrs, fmt.Errorf("kubelet %s: delete Node: %w", k.node, err))
	}
	if err := k.kube.CoordinationV1().Leases(corev1.NamespaceNodeLease).Delete(ctx, k.node, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		deleteErrs = append(deleteErrs, fmt.Errorf("kubelet %s: delete node Lease: %w", k.node, err))
	}
	return errors.Join(stopErrs...), errors.Join(deleteErrs...)
}
