package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/internal/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testdriver"
	"github.com/csi-sidecars/csi-sidecars/internal/testsidecar"
)

var kube controlplane.Shared

// binDir holds the binaries built once for the package.
var binDir string

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "csi-sidecars-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	binDir = dir
	for _, pkg := range []string{"./cmd/csi-sidecars", "./internal/testsidecar/csi-test-sidecar"} {
		cmd := exec.Command("go", "build", "-o", dir, pkg)
		cmd.Dir = "../.."
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			fmt.Fprintf(os.Stderr, "building %s: %v\n", pkg, err)
			return 1
		}
	}
	return kube.Main(m, controlplane.Options{})
}

// scenario is one test's world: its namespace, driver name (so its own Lease), a test CSI
// driver with one socket per replica, and the replicas it started.
type scenario struct {
	t         *testing.T
	cp        *controlplane.ControlPlane
	client    kubernetes.Interface
	namespace string
	driver    *testdriver.Backend
	dir       string
	leaseName string
}

func newScenario(t *testing.T, cfg testdriver.Config) *scenario {
	t.Helper()
	cp := kube.Get(t)
	client := kubernetes.NewForConfigOrDie(cp.Config())
	ns := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	if len(ns) > 50 {
		ns = ns[:50]
	}
	ns = strings.Trim(ns, "-")
	if _, err := client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating namespace: %v", err)
	}
	cfg.DriverName = ns + ".csi.test"
	d, err := testdriver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return &scenario{t: t, cp: cp, client: client, namespace: ns, driver: d, dir: dir,
		leaseName: "csi-sidecars-test-" + strings.ReplaceAll(cfg.DriverName, ".", "-")}
}

// replica is one sidecar process.
type replica struct {
	name     string
	socket   string
	driver   *testdriver.Server
	health   string
	cmd      *exec.Cmd
	stderr   *lockedBuffer
	done     chan struct{}
	exitCode int
	exitedAt time.Time
}

// startReplica starts the test sidecar as a process with its own driver socket. Lease timings
// are long on purpose: a replica that polled instead of watching would need a retry
// period (10 s) to take over, which the takeover assertions would catch.
func (s *scenario) startReplica(name string, extra ...string) *replica {
	s.t.Helper()
	srv, err := s.driver.Serve(filepath.Join(s.dir, name+".sock"))
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(srv.Stop)
	port := freePort(s.t)
	args := append([]string{"test",
		"--csi-address=" + srv.Endpoint(),
		"--kubeconfig=" + s.cp.KubeconfigPath(),
		"--namespace=" + s.namespace,
		"--leader-election",
		"--leader-election-namespace=" + s.namespace,
		"--leader-election-identity=" + name,
		"--leader-election-lease-duration=30s",
		"--leader-election-renew-deadline=20s",
		"--leader-election-retry-period=10s",
		"--http-endpoint=127.0.0.1:" + port,
		"--workers=4",
		"-v=2",
	}, extra...)
	r := &replica{name: name, socket: srv.Socket(), driver: srv, health: "http://127.0.0.1:" + port, stderr: &lockedBuffer{}, done: make(chan struct{})}
	r.cmd = exec.Command(filepath.Join(binDir, "csi-test-sidecar"), args...)
	logFile, err := os.Create(filepath.Join(s.dir, name+".log"))
	if err != nil {
		s.t.Fatal(err)
	}
	r.cmd.Stdout = logFile
	r.cmd.Stderr = io.MultiWriter(logFile, r.stderr)
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := r.cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	go func() {
		_ = r.cmd.Wait()
		r.exitedAt = time.Now()
		r.exitCode = r.cmd.ProcessState.ExitCode()
		logFile.Close()
		close(r.done)
	}()
	s.t.Cleanup(func() {
		_ = r.cmd.Process.Kill()
		<-r.done
		if s.t.Failed() {
			s.t.Logf("--- log of %s ---\n%s", name, r.stderr.String())
		}
	})
	return r
}

func (r *replica) signal(t *testing.T, sig syscall.Signal) time.Time {
	t.Helper()
	at := time.Now()
	if err := r.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signalling %s: %v", r.name, err)
	}
	return at
}

// wait waits for the replica to exit and returns its exit code.
func (r *replica) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-r.done:
		return r.exitCode
	case <-time.After(timeout):
		t.Fatalf("%s did not exit within %v", r.name, timeout)
		return -1
	}
}

func (r *replica) running() bool {
	select {
	case <-r.done:
		return false
	default:
		return true
	}
}

// waitReady waits until /readyz answers 200: the replica is connected, set up, and its
// caches are synced.
func (r *replica) waitReady(t *testing.T) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		if !r.running() {
			return false, fmt.Errorf("%s exited with %d", r.name, r.exitCode)
		}
		code, _ := r.get("/readyz")
		return code == http.StatusOK, nil
	})
	if err != nil {
		t.Fatalf("%s not ready: %v\n%s", r.name, err, r.stderr.String())
	}
}

func (r *replica) get(path string) (int, string) {
	resp, err := http.Get(r.health + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

func (s *scenario) lease() *coordinationv1.Lease {
	s.t.Helper()
	l, err := s.client.CoordinationV1().Leases(s.namespace).Get(context.Background(), s.leaseName, metav1.GetOptions{})
	if err != nil {
		s.t.Fatalf("getting the Lease: %v", err)
	}
	return l
}

func holder(l *coordinationv1.Lease) string {
	if l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

func (s *scenario) waitForHolder(want string) {
	s.t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		l, err := s.client.CoordinationV1().Leases(s.namespace).Get(ctx, s.leaseName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		return holder(l) == want, nil
	})
	if err != nil {
		s.t.Fatalf("Lease holder never became %q", want)
	}
}

// createWork creates n labelled ConfigMaps: each is one CSI call for the leader.
func (s *scenario) createWork(n int) {
	s.t.Helper()
	for i := range n {
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{
			Name:   fmt.Sprintf("work-%02d", i),
			Labels: map[string]string{testsidecar.WorkLabel: "yes"},
		}}
		if _, err := s.client.CoreV1().ConfigMaps(s.namespace).Create(context.Background(), cm, metav1.CreateOptions{}); err != nil {
			s.t.Fatal(err)
		}
	}
}

// results maps each work ConfigMap's volume name to its recorded result ("" if none).
func (s *scenario) results() map[string]string {
	s.t.Helper()
	list, err := s.client.CoreV1().ConfigMaps(s.namespace).List(context.Background(), metav1.ListOptions{LabelSelector: testsidecar.WorkLabel})
	if err != nil {
		s.t.Fatal(err)
	}
	out := map[string]string{}
	for _, cm := range list.Items {
		out[testsidecar.VolumePrefix+cm.Name] = cm.Annotations[testsidecar.ResultAnnotation]
	}
	return out
}

// waitForCalls waits until the driver's journal satisfies cond.
func (s *scenario) waitForCalls(what string, cond func([]testdriver.Call) bool) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := s.driver.WaitFor(ctx, cond); err != nil {
		s.t.Fatalf("waiting for %s: %v", what, err)
	}
}

// callsOn returns the CreateVolume calls received on a replica's socket.
func callsOn(calls []testdriver.Call, r *replica) []testdriver.Call {
	var out []testdriver.Call
	for _, c := range calls {
		if c.Socket == r.socket && c.Method == "CreateVolume" {
			out = append(out, c)
		}
	}
	return out
}

func running(calls []testdriver.Call) int {
	n := 0
	for _, c := range calls {
		if !c.Done() {
			n++
		}
	}
	return n
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	return port
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// waitUntil polls cond (no API of its own to wait on) until it holds or 60 s pass.
func (s *scenario) waitUntil(what string, cond func() bool) {
	s.t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		return cond(), nil
	})
	if err != nil {
		s.t.Fatalf("waiting until %s: %v", what, err)
	}
}

func exitCode(err error) int {
	if err == nil {
		return 0
	}
	if e, ok := err.(*exec.ExitError); ok {
		return e.ExitCode()
	}
	return -1
}

// writeKubeconfig writes a kubeconfig for a server that is not there.
func writeKubeconfig(t *testing.T, dir, server string) string {
	t.Helper()
	path := filepath.Join(dir, "unreachable.kubeconfig")
	content := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: %q, insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`, server)
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
