// Package node runs `csi-sidecars node-driver-registrar` next to a real kubelet (the test
// kit's hollow kubelet: the kubelet's own code with a fake container runtime) and checks
// what a cluster can observe: the node's CSINode and its Node's csi.volume.kubernetes.io/nodeid
// annotation, written by the kubelet from what the registrar told it; an attach to that node
// by `csi-sidecars attacher`, which reads them; the registrar's exit codes and its
// registration socket across SIGTERM, SIGKILL and kubelet restarts. The CSI driver is the
// test driver served in the test process at <kubelet plugins dir>/<driver>/csi.sock, so
// that a test can hold the kubelet's NodeGetInfo.
//
// BenchmarkNodeContainerMemory (make bench) reads the memory of the node container, the
// registrar and the livenessprobe in one process, registered and then probed once a second.
package node

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/resourceversion"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/kubelet"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

var (
	kube   controlplane.Shared
	binDir string
)

// TestMain starts one control plane for the package; every test runs a kubelet (a Node) of
// its own and a driver of its own name, and calls t.Parallel().
func TestMain(m *testing.M) { os.Exit(e2e.Main(m, "../../..", &kube, &binDir)) }

// registrarLogTail is how many lines of a registrar's log a failed test shows.
const registrarLogTail = 80

// driverConfig is the test driver of a node: NodeGetInfo reports nodeID and a topology
// segment, and ControllerPublishVolume accepts that node ID only.
func driverConfig(name, nodeID string) testdriver.Config {
	return testdriver.Config{DriverName: name, NodeID: nodeID, Topology: true, Nodes: []string{}}
}

// testNode is a real kubelet with the test driver of a node served where a node plugin
// serves its socket, and a watch of the node's CSINode.
type testNode struct {
	ctx            context.Context // ends with the test, or after its timeout
	client         kubernetes.Interface
	kubelet        *kubelet.Kubelet
	driver, nodeID string
	backend        *testdriver.Backend
	plugin         *testdriver.Server
	csiNodes       *csiNodeWatch
}

// startNode starts a kubelet and serves driver's test driver for it, reporting node ID
// "id-<node>"; the test gets timeout.
func startNode(t *testing.T, driver string, timeout time.Duration) *testNode {
	t.Helper()
	e2e.RequireBinaries(t, binDir)
	cp := kube.Get(t)
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	t.Cleanup(cancel)
	n := &testNode{ctx: ctx, client: kubernetes.NewForConfigOrDie(cp.Config()), kubelet: kubelet.Start(ctx, t, cp, kubelet.Options{}), driver: driver}
	n.nodeID = "id-" + n.kubelet.NodeName()
	b, err := testdriver.New(driverConfig(driver, n.nodeID))
	if err != nil {
		t.Fatal(err)
	}
	n.backend, n.plugin = b, serveDriver(t, n.kubelet, b)
	n.csiNodes = watchCSINode(ctx, t, n.client, n.kubelet.NodeName())
	return n
}

// serveDriver serves b where a node plugin serves its socket, <PluginsDir>/<driver>/csi.sock.
func serveDriver(t *testing.T, k *kubelet.Kubelet, b *testdriver.Backend) *testdriver.Server {
	t.Helper()
	dir := filepath.Join(k.PluginsDir(), b.DriverName())
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	srv, err := b.Serve(filepath.Join(dir, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return srv
}

// registrar is one `csi-sidecars node-driver-registrar` process.
type registrar struct {
	child *controlplane.Child
	// socket is the registration socket it places for the kubelet.
	socket  string
	http    string
	started time.Time
}

// startRegistrar runs the registrar of the driver served at driverSocket for k's kubelet,
// as a node plugin's DaemonSet runs it: the driver socket is both --csi-address and
// --kubelet-registration-path (one host path), the registration dir the kubelet's. It
// serves its diagnostics on a free port. extra may override any flag.
func startRegistrar(t *testing.T, k *kubelet.Kubelet, driver, driverSocket string, extra ...string) *registrar {
	t.Helper()
	e2e.RequireBinaries(t, binDir)
	port := e2e.FreePort(t)
	args := append([]string{
		"node-driver-registrar",
		"--csi-address=" + driverSocket,
		"--kubelet-registration-path=" + driverSocket,
		"--plugin-registration-path=" + k.RegistrationDir(),
		"--http-endpoint=127.0.0.1:" + port,
		"-v=4",
	}, extra...)
	logPath := filepath.Join(t.TempDir(), fmt.Sprintf("registrar-%d.log", time.Now().UnixNano()))
	r := &registrar{
		socket:  filepath.Join(k.RegistrationDir(), driver+"-reg.sock"),
		http:    "http://127.0.0.1:" + port,
		started: time.Now(),
	}
	child, err := controlplane.StartChild(filepath.Join(binDir, "csi-sidecars"), logPath, args...)
	if err != nil {
		t.Fatal(err)
	}
	r.child = child
	t.Cleanup(func() {
		if err := child.Stop(); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("--- last lines of registrar pid %d (%s) ---\n%s", child.Pid(), logPath, tail(logPath, registrarLogTail))
		}
	})
	return r
}

// tail is the last n lines of the file at path.
func tail(path string, n int) string {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(raw), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// signal sends sig to the registrar.
func (r *registrar) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := syscall.Kill(r.child.Pid(), sig); err != nil {
		t.Fatalf("signalling the registrar: %v", err)
	}
}

func (r *registrar) running() bool {
	select {
	case <-r.child.Done():
		return false
	default:
		return true
	}
}

// exitCode is the registrar's exit code once it has exited.
func (r *registrar) exitCode() int {
	<-r.child.Done()
	return e2e.ExitCode(r.child.Err())
}

// wait waits for the registrar to exit and returns its exit code.
func (r *registrar) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-r.child.Done():
		return e2e.ExitCode(r.child.Err())
	case <-time.After(timeout):
		t.Fatalf("the registrar did not exit within %v", timeout)
		return -1
	}
}

// readyz is the status of the registrar's /readyz, 0 when it does not answer.
func (r *registrar) readyz() int {
	rsp, err := http.Get(r.http + "/readyz")
	if err != nil {
		return 0
	}
	rsp.Body.Close()
	return rsp.StatusCode
}

// waitDraining waits until the registrar has taken a termination signal: its /readyz
// answers 503 while it drains. It fails t if the registrar exits first.
func (r *registrar) waitDraining(ctx context.Context, t *testing.T) {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for r.readyz() != http.StatusServiceUnavailable {
		select {
		case <-r.child.Done():
			t.Fatalf("the registrar exited (code %d) instead of draining", e2e.ExitCode(r.child.Err()))
		case <-ctx.Done():
			t.Fatalf("the registrar's /readyz never reported the drain: %v", ctx.Err())
		case <-tick.C:
		}
	}
}

// socketFile is the registration socket's file; it fails t unless the path holds a socket.
func socketFile(t *testing.T, path string) os.FileInfo {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatalf("registration socket: %v", err)
	}
	if fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("registration socket %s is a %v, not a socket", path, fi.Mode())
	}
	return fi
}

// answers tells whether a process listens on the UNIX socket at path.
func answers(path string) (bool, error) {
	conn, err := net.DialTimeout("unix", path, time.Second)
	switch {
	case err == nil:
		conn.Close()
		return true, nil
	case errors.Is(err, syscall.ECONNREFUSED):
		return false, nil
	}
	return false, err
}

// driverIn is the driver's entry in n, nil when n is nil or does not list it.
func driverIn(n *storagev1.CSINode, driver string) *storagev1.CSINodeDriver {
	if n == nil {
		return nil
	}
	for i := range n.Spec.Drivers {
		if n.Spec.Drivers[i].Name == driver {
			return &n.Spec.Drivers[i]
		}
	}
	return nil
}

// csiNodeWatch follows one node's CSINode through a watch, from when it was made on: every
// change the API server made is seen, in order.
type csiNodeWatch struct {
	t    *testing.T
	node string
	w    *watchtools.RetryWatcher
	cur  *storagev1.CSINode // nil: none
}

// watchCSINode starts following node's CSINode until t ends.
func watchCSINode(ctx context.Context, t *testing.T, client kubernetes.Interface, node string) *csiNodeWatch {
	t.Helper()
	sel := fields.OneTermEqualSelector("metadata.name", node).String()
	list, err := client.StorageV1().CSINodes().List(ctx, metav1.ListOptions{FieldSelector: sel})
	if err != nil {
		t.Fatalf("list CSINode %s: %v", node, err)
	}
	lw := &cache.ListWatch{WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
		opts.FieldSelector = sel
		return client.StorageV1().CSINodes().Watch(ctx, opts)
	}}
	w, err := watchtools.NewRetryWatcherWithContext(context.WithoutCancel(ctx), list.ResourceVersion, lw)
	if err != nil {
		t.Fatalf("watch CSINode %s: %v", node, err)
	}
	t.Cleanup(w.Stop)
	cw := &csiNodeWatch{t: t, node: node, w: w}
	if len(list.Items) == 1 {
		cw.cur = &list.Items[0]
	}
	return cw
}

// next returns the CSINode after its next change; ok false when ctx ended first.
func (cw *csiNodeWatch) next(ctx context.Context) (n *storagev1.CSINode, ok bool) {
	cw.t.Helper()
	select {
	case <-ctx.Done():
		return cw.cur, false
	case ev, open := <-cw.w.ResultChan():
		if !open {
			cw.t.Fatalf("the watch of CSINode %s ended", cw.node)
		}
		switch ev.Type {
		case watch.Added, watch.Modified:
			cw.cur = ev.Object.(*storagev1.CSINode)
		case watch.Deleted:
			cw.cur = nil
		case watch.Error:
			cw.t.Fatalf("watch of CSINode %s: %v", cw.node, ev.Object)
		}
		return cw.cur, true
	}
}

// until returns the CSINode once ok accepts it (nil: none), now or after changes. It fails
// t with the last one seen when ctx ends first.
func (cw *csiNodeWatch) until(ctx context.Context, what string, ok func(*storagev1.CSINode) bool) *storagev1.CSINode {
	cw.t.Helper()
	for !ok(cw.cur) {
		if _, more := cw.next(ctx); !more {
			cw.t.Fatalf("waiting until CSINode %s %s: %v; last seen: %+v", cw.node, what, ctx.Err(), cw.cur)
		}
	}
	return cw.cur
}

// untilWrittenAfter is until for a CSINode written after the one of resourceVersion mark:
// an older one is not taken, whatever it lists.
func (cw *csiNodeWatch) untilWrittenAfter(ctx context.Context, mark, what string, ok func(*storagev1.CSINode) bool) *storagev1.CSINode {
	cw.t.Helper()
	return cw.until(ctx, what+" (written after resourceVersion "+mark+")", func(n *storagev1.CSINode) bool {
		if n == nil {
			return false
		}
		newer, err := resourceversion.CompareResourceVersion(n.ResourceVersion, mark)
		if err != nil {
			cw.t.Fatalf("CSINode %s: %v", cw.node, err)
		}
		return newer > 0 && ok(n)
	})
}

// holds fails t if, within d, the CSINode changes so that ok no longer accepts it. It is
// no wait for a condition: it watches that nothing undoes one.
func (cw *csiNodeWatch) holds(ctx context.Context, d time.Duration, what string, ok func(*storagev1.CSINode) bool) {
	cw.t.Helper()
	if !ok(cw.cur) {
		cw.t.Fatalf("CSINode %s no longer %s: %+v", cw.node, what, cw.cur)
	}
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	for {
		n, more := cw.next(ctx)
		if !more {
			return
		}
		if !ok(n) {
			cw.t.Fatalf("CSINode %s no longer %s: %+v", cw.node, what, n)
		}
	}
}

// nodeGetInfoSince waits until a NodeGetInfo that started after since has answered, and
// returns it.
func nodeGetInfoSince(ctx context.Context, t *testing.T, b *testdriver.Backend, since time.Time) testdriver.Call {
	t.Helper()
	var got testdriver.Call
	err := b.WaitFor(ctx, func(calls []testdriver.Call) bool {
		for _, c := range testdriver.CallsOf(calls, testdriver.MethodNodeGetInfo) {
			if c.Start.After(since) && c.Done() && c.Code == "OK" {
				got = c
				return true
			}
		}
		return false
	})
	if err != nil {
		t.Fatalf("waiting for the kubelet's NodeGetInfo after %s: %v", since.Format(time.StampMilli), err)
	}
	return got
}
