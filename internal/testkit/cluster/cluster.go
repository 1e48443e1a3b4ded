// Package cluster runs "the real control loop" next to a test control plane: a real
// kube-controller-manager and kube-scheduler (the versions of kube-apiserver, built by
// hack/control-plane.sh) as child processes, and fake nodes that look to them like nodes
// with a kubelet and a CSI node plugin, so that end-to-end tests can take Pods with claims
// through their whole life as in a cluster.
//
// A Cluster owns the two processes (their logs go to the control plane's log folder unless
// told otherwise), the fake Nodes with their heartbeats (the Ready condition and the Node
// Lease, renewed as a kubelet does), a CSINode per node naming the CSI driver with the
// node's driver node ID, and the driver's CSIDriver object. Stop ends the processes and
// removes those objects. It does not run a kubelet: Pods are scheduled (spec.nodeName set,
// their volumes attached) but never run, so a test deletes them with grace period 0.
//
// A Workload (workload.go) is the user: it creates Pods, each with a new claim of a
// WaitForFirstConsumer StorageClass, grows and deletes the claims, waits for each stage of
// their life and records when every stage was reached, for tests and benchmarks.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
)

// The binaries Start runs, built next to kube-apiserver by hack/control-plane.sh.
const (
	ControllerManagerBinary = "kube-controller-manager"
	SchedulerBinary         = "kube-scheduler"
)

// DefaultControllers are the kube-controller-manager controllers Start runs unless
// Options.Controllers says otherwise: what a claim's life needs (binding and provisioning
// hand-over, expansion hand-over, attach and detach, the protection finalizers), the node
// lifecycle (it removes the not-ready taint every new Node starts with) and the
// ServiceAccount controllers (a Pod needs its namespace's "default" ServiceAccount).
func DefaultControllers() []string {
	return []string{
		"persistentvolume-binder-controller",
		"persistentvolume-expander-controller",
		"persistentvolume-attach-detach-controller",
		"persistentvolume-protection-controller",
		"persistentvolumeclaim-protection-controller",
		"node-lifecycle-controller",
		"serviceaccount-controller",
		"serviceaccount-token-controller",
	}
}

const (
	defaultReadyTimeout      = 60 * time.Second
	defaultHeartbeatInterval = 2 * time.Second
	// nodeLeaseSeconds is the Node Lease's duration, as the kubelet's default.
	nodeLeaseSeconds = 40
	// cleanupTimeout bounds Stop's deletion of the objects Start created.
	cleanupTimeout = 20 * time.Second
	// startAttempts covers a free port taken by another process before the child binds it.
	startAttempts = 3
	logTailLines  = 25
)

// Options tunes Start. The zero value starts the two processes with no nodes.
type Options struct {
	// LogDir receives kube-controller-manager.log and kube-scheduler.log (appended to).
	// Default: the control plane's LogDir.
	LogDir string
	// AssetsDir holds the two binaries. Default: Assets().
	AssetsDir string

	// Nodes is how many fake nodes to register, named <NodePrefix>-<i> from 0.
	Nodes int
	// NodePrefix names the nodes; default "node". Use a name of the test's own (its
	// namespace) when several tests share a control plane.
	NodePrefix string
	// Driver is the CSI driver every node has installed: it gets a CSIDriver object
	// (attachRequired) and an entry in each node's CSINode. Empty: no CSI objects.
	Driver string
	// MoreDrivers are further CSI drivers every node has installed, each set up as
	// Driver is, with the same node IDs and TopologyKey: a second driver under test that
	// must not share the first one's objects.
	MoreDrivers []string
	// NodeID maps a node name to the driver's node ID for it (the CSINode entry and the
	// csi.volume.kubernetes.io/nodeid annotation). Default: the node name.
	NodeID func(node string) string
	// TopologyKey, if set, labels each node with TopologyKey=<node ID> and lists the key in
	// its CSINode entry, as a node plugin reporting that topology segment would.
	TopologyKey string
	// NodeCapacity is each node's capacity and allocatable; the pods entry matters to the
	// scheduler. Default: 8 CPUs, 32Gi of memory, 110 pods.
	NodeCapacity map[string]string

	// Controllers is kube-controller-manager's --controllers list. Default:
	// DefaultControllers().
	Controllers []string
	// ControllerManagerArgs and SchedulerArgs are appended to the command lines; a
	// repeated flag overrides the default.
	ControllerManagerArgs []string
	SchedulerArgs         []string

	// HeartbeatInterval is how often each node's Ready condition and Lease are renewed.
	// Default: 2s.
	HeartbeatInterval time.Duration
	// ReadyTimeout bounds Start's wait for the processes to serve and the nodes to lose
	// their not-ready taint. Default: 60s.
	ReadyTimeout time.Duration
}

// Cluster is a running kube-controller-manager and kube-scheduler with fake nodes. Its
// methods are safe for concurrent use.
type Cluster struct {
	cp     *controlplane.ControlPlane
	kube   kubernetes.Interface
	opts   Options
	dir    string // temporary folder (the scheduler's configuration); removed by Stop
	nodes  []string
	nodeID map[string]string

	controllerManager *controlplane.Child
	scheduler         *controlplane.Child

	stopHeartbeats context.CancelFunc
	heartbeatsDone chan struct{}

	mu           sync.Mutex
	heartbeatErr error // the last failed heartbeat's error, nil once one succeeds
	heartbeatN   int   // failed heartbeats so far

	stopOnce sync.Once
	stopErr  error
}

// Assets returns the folder holding kube-controller-manager and kube-scheduler: the
// control plane's assets folder. The error names what is missing and says how to build it,
// so a test can skip with it.
func Assets() (string, error) {
	dir, err := controlplane.Assets()
	if err != nil {
		return "", err
	}
	if err := checkBinaries(dir); err != nil {
		return "", err
	}
	return dir, nil
}

func checkBinaries(dir string) error {
	for _, bin := range []string{ControllerManagerBinary, SchedulerBinary} {
		path := filepath.Join(dir, bin)
		fi, err := os.Stat(path)
		switch {
		case errors.Is(err, os.ErrNotExist):
			err = fmt.Errorf("%s is missing", path)
		case err == nil && (fi.IsDir() || fi.Mode().Perm()&0o111 == 0):
			err = fmt.Errorf("%s is not an executable file", path)
		}
		if err != nil {
			return fmt.Errorf("cluster: %w; run `make testenv` (hack/control-plane.sh) to build kube-controller-manager and kube-scheduler %s into %s",
				err, controlplane.KubernetesVersion, dir)
		}
	}
	return nil
}

// Start registers the nodes (with their CSINodes and Leases, heartbeats running) and the
// CSIDrivers, starts kube-controller-manager and kube-scheduler against cp, and returns once
// both serve their health endpoints and every node has lost the not-ready taint (so Pods
// can be scheduled there). ctx bounds the start. Stop ends the cluster; a failed Start has
// cleaned up after itself already.
func Start(ctx context.Context, cp *controlplane.ControlPlane, opts Options) (c *Cluster, err error) {
	if opts.AssetsDir == "" {
		if opts.AssetsDir, err = Assets(); err != nil {
			return nil, err
		}
	} else if err := checkBinaries(opts.AssetsDir); err != nil {
		return nil, err
	}
	if opts.LogDir == "" {
		opts.LogDir = cp.LogDir()
	}
	if opts.NodePrefix == "" {
		opts.NodePrefix = "node"
	}
	if opts.NodeID == nil {
		opts.NodeID = func(node string) string { return node }
	}
	if opts.Controllers == nil {
		opts.Controllers = DefaultControllers()
	}
	if opts.HeartbeatInterval <= 0 {
		opts.HeartbeatInterval = defaultHeartbeatInterval
	}
	if opts.ReadyTimeout <= 0 {
		opts.ReadyTimeout = defaultReadyTimeout
	}
	kube, err := kubernetes.NewForConfig(cp.Config())
	if err != nil {
		return nil, fmt.Errorf("cluster: client: %w", err)
	}
	dir, err := os.MkdirTemp("", "csi-sidecars-cluster-")
	if err != nil {
		return nil, fmt.Errorf("cluster: temporary folder: %w", err)
	}
	c = &Cluster{cp: cp, kube: kube, opts: opts, dir: dir, nodeID: map[string]string{}}
	for i := range opts.Nodes {
		name := fmt.Sprintf("%s-%d", opts.NodePrefix, i)
		c.nodes = append(c.nodes, name)
		c.nodeID[name] = opts.NodeID(name)
	}
	defer func() {
		if err != nil {
			_ = c.Stop()
			c = nil
		}
	}()

	readyCtx, cancel := context.WithTimeout(ctx, opts.ReadyTimeout)
	defer cancel()
	if err := c.register(readyCtx); err != nil {
		return c, err
	}
	c.startHeartbeats()

	if c.controllerManager, err = c.startChild(readyCtx, ControllerManagerBinary, "/healthz", c.controllerManagerArgs); err != nil {
		return c, err
	}
	schedulerArgs, err := c.writeSchedulerConfig()
	if err != nil {
		return c, err
	}
	if c.scheduler, err = c.startChild(readyCtx, SchedulerBinary, "/readyz", schedulerArgs); err != nil {
		return c, err
	}
	if slices.Contains(opts.Controllers, "node-lifecycle-controller") || slices.Contains(opts.Controllers, "nodelifecycle") {
		if err := c.waitSchedulable(readyCtx); err != nil {
			return c, err
		}
	}
	return c, nil
}

func (c *Cluster) controllerManagerArgs(port int) []string {
	args := []string{
		"--kubeconfig=" + c.cp.KubeconfigPath(),
		"--controllers=" + strings.Join(c.opts.Controllers, ","),
		"--use-service-account-credentials=false",
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--service-account-private-key-file=" + c.cp.ServiceAccountKeyPath(),
		"--root-ca-file=" + c.cp.CAPath(),
		// The PV controller acts on events; its periodic sync only retries what a
		// conflicting write made it drop, which the default 15 s would make the slowest
		// step of a test.
		"--pvclaimbinder-sync-period=2s",
		"-v=2",
	}
	return append(args, c.opts.ControllerManagerArgs...)
}

// writeSchedulerConfig writes the scheduler's configuration file and returns a function
// for its arguments.
func (c *Cluster) writeSchedulerConfig() (func(int) []string, error) {
	path := filepath.Join(c.dir, "kube-scheduler.yaml")
	// Short back-offs: a Pod tried before its node lost the not-ready taint, or before a
	// volume's objects were in the scheduler's cache, is tried again within seconds.
	config := fmt.Sprintf(`apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: %q
leaderElection:
  leaderElect: false
podInitialBackoffSeconds: 1
podMaxBackoffSeconds: 2
`, c.cp.KubeconfigPath())
	if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
		return nil, fmt.Errorf("cluster: write the scheduler's configuration: %w", err)
	}
	return func(port int) []string {
		args := []string{
			"--config=" + path,
			"--bind-address=127.0.0.1",
			"--secure-port=" + strconv.Itoa(port),
			"-v=2",
		}
		return append(args, c.opts.SchedulerArgs...)
	}, nil
}

// startChild starts binary with args(port) on a free port and waits until health answers
// there; a port taken meanwhile is retried with another.
func (c *Cluster) startChild(ctx context.Context, binary, health string, args func(port int) []string) (*controlplane.Child, error) {
	logPath := filepath.Join(c.opts.LogDir, binary+".log")
	var err error
	for range startAttempts {
		var port int
		if port, err = freePort(); err != nil {
			return nil, err
		}
		var child *controlplane.Child
		child, err = controlplane.StartChild(filepath.Join(c.opts.AssetsDir, binary), logPath, args(port)...)
		if err != nil {
			return nil, fmt.Errorf("cluster: %w", err)
		}
		err = child.WaitHTTPS(ctx, "https://127.0.0.1:"+strconv.Itoa(port)+health)
		if err == nil {
			return child, nil
		}
		_ = child.Stop()
		tail := child.LogTail(logTailLines)
		err = fmt.Errorf("cluster: %s did not become ready: %w\nlog: %s\nlast lines (klog info and warnings omitted):\n%s", binary, err, logPath, tail)
		if !strings.Contains(tail, "address already in use") || ctx.Err() != nil {
			break
		}
	}
	return nil, err
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("cluster: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// drivers are Driver and MoreDrivers.
func (c *Cluster) drivers() []string {
	var out []string
	if c.opts.Driver != "" {
		out = append(out, c.opts.Driver)
	}
	return append(out, c.opts.MoreDrivers...)
}

// Nodes are the fake nodes' names.
func (c *Cluster) Nodes() []string { return slices.Clone(c.nodes) }

// NodeID is the driver's node ID of a node ("" for a node of another cluster).
func (c *Cluster) NodeID(node string) string { return c.nodeID[node] }

// ControllerManager is the running kube-controller-manager, for its log and exit.
func (c *Cluster) ControllerManager() *controlplane.Child { return c.controllerManager }

// Scheduler is the running kube-scheduler.
func (c *Cluster) Scheduler() *controlplane.Child { return c.scheduler }

// Running reports an error when either process has exited, with the tail of its log.
func (c *Cluster) Running() error {
	var errs []error
	for _, child := range []*controlplane.Child{c.controllerManager, c.scheduler} {
		if child == nil {
			continue
		}
		select {
		case <-child.Done():
			errs = append(errs, fmt.Errorf("cluster: %s exited: %v; log %s ends:\n%s", child.Name(), child.Err(), child.LogPath(), child.LogTail(logTailLines)))
		default:
		}
	}
	return errors.Join(errs...)
}

// Diagnostics says where the processes' logs are, with their tails, and how the
// heartbeats fare: what a failing test should print.
func (c *Cluster) Diagnostics() string {
	var b strings.Builder
	for _, child := range []*controlplane.Child{c.controllerManager, c.scheduler} {
		if child == nil {
			continue
		}
		fmt.Fprintf(&b, "--- %s (pid %d), log %s, last lines (klog info and warnings omitted):\n%s\n", child.Name(), child.Pid(), child.LogPath(), child.LogTail(logTailLines))
	}
	c.mu.Lock()
	if c.heartbeatN > 0 {
		fmt.Fprintf(&b, "--- %d node heartbeats failed; the last: %v\n", c.heartbeatN, c.heartbeatErr)
	}
	c.mu.Unlock()
	return b.String()
}

// Stop ends the heartbeats, kills kube-scheduler and kube-controller-manager and deletes
// the objects Start created (Nodes, their Leases and CSINodes, the CSIDrivers). Pods and
// claims are the test's to delete. It is idempotent and a nil Cluster is a no-op.
func (c *Cluster) Stop() error {
	if c == nil {
		return nil
	}
	c.stopOnce.Do(func() {
		if c.stopHeartbeats != nil {
			c.stopHeartbeats()
			<-c.heartbeatsDone
		}
		var errs []error
		for _, child := range []*controlplane.Child{c.scheduler, c.controllerManager} {
			if err := child.Stop(); err != nil {
				errs = append(errs, err)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		defer cancel()
		if err := c.unregister(ctx); err != nil {
			errs = append(errs, err)
		}
		if err := os.RemoveAll(c.dir); err != nil {
			errs = append(errs, err)
		}
		c.stopErr = errors.Join(errs...)
	})
	return c.stopErr
}
