// Package e2e is the harness of the end-to-end tests: it builds the binaries, runs sidecar
// replicas as processes against the shared local control plane, each with its own socket on
// the test CSI driver, and waits on what they make observable (Lease holder, driver journal,
// exit codes, /readyz). Test packages under test/ use it; it holds no state of its own
// beyond what a Scenario owns.
package e2e

import (
	"bytes"
	"context"
	"errors"
	"flag"
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
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// Binaries builds csi-sidecars and csi-test-sidecar into a new temporary folder and returns
// it; remove it when done. root is the path of the repository root from the caller.
func Binaries(root string) (string, error) {
	dir, err := os.MkdirTemp("", "csi-sidecars-e2e-bin-")
	if err != nil {
		return "", err
	}
	for _, pkg := range []string{"./cmd/csi-sidecars", "./internal/testkit/testsidecar/csi-test-sidecar"} {
		cmd := exec.Command("go", "build", "-o", dir, pkg)
		cmd.Dir = root
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			os.RemoveAll(dir)
			return "", fmt.Errorf("building %s: %w", pkg, err)
		}
	}
	return dir, nil
}

// Main is a TestMain for an end-to-end package: it builds the binaries into *binDir and
// runs the tests with one shared control plane. Without a control plane (-short, or
// CSI_SIDECARS_SKIP_CONTROLPLANE=1) nothing is built and *binDir stays empty: the tests
// skip (RequireBinaries).
func Main(m *testing.M, root string, kube *controlplane.Shared, binDir *string) int {
	return MainWith(m, root, kube, binDir, controlplane.Options{})
}

// MainWith is Main with options for the control plane, for example an audit log's
// kube-apiserver flags.
func MainWith(m *testing.M, root string, kube *controlplane.Shared, binDir *string, opts controlplane.Options) int {
	if !flag.Parsed() {
		flag.Parse()
	}
	if !testing.Short() && os.Getenv(controlplane.SkipEnv) != "1" {
		dir, err := Binaries(root)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		*binDir = dir
	}
	return kube.Main(m, opts)
}

// Benchmarks tells whether this test binary runs benchmarks (-test.bench given), for a
// TestMain that prepares what only benchmarks need, such as an audit log.
func Benchmarks() bool {
	bench := flag.Lookup("test.bench")
	return bench != nil && bench.Value.String() != ""
}

// RequireBinaries skips t when Main built no binaries (a run without a control plane).
func RequireBinaries(t testing.TB, binDir string) {
	t.Helper()
	if binDir == "" {
		t.Skip("binaries are built only for runs with a control plane (not -short)")
	}
}

// Scenario is one test's world: its own namespace, a test CSI driver named after it (so
// its own Leases), a socket on that driver per replica, and the processes it started.
type Scenario struct {
	T         testing.TB
	CP        *controlplane.ControlPlane
	Client    kubernetes.Interface
	Namespace string
	Driver    *testdriver.Backend
	// Dir holds the sockets and each replica's log (<name>.log).
	Dir    string
	BinDir string
}

// NewScenario creates the namespace (named after the test) and the driver.
func NewScenario(t testing.TB, cp *controlplane.ControlPlane, binDir string, cfg testdriver.Config) *Scenario {
	t.Helper()
	client := kubernetes.NewForConfigOrDie(cp.Config())
	// A namespace name is a DNS label: subtest names ("every=1s") may hold other characters.
	ns := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			return r
		}
		return '-'
	}, strings.ToLower(t.Name()))
	if len(ns) > 50 {
		ns = ns[:50]
	}
	ns = strings.Trim(ns, "-")
	// A repeated run (-count=2) finds the namespace of the run before: number the next one.
	base := ns
	for i := 2; ; i++ {
		_, err := client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		if err == nil {
			break
		}
		if !apierrors.IsAlreadyExists(err) {
			t.Fatalf("creating namespace: %v", err)
		}
		ns = fmt.Sprintf("%s-%d", base, i)
	}
	if cfg.DriverName == "" {
		cfg.DriverName = ns + ".csi.test"
	}
	d, err := testdriver.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return &Scenario{T: t, CP: cp, Client: client, Namespace: ns, Driver: d, Dir: dir, BinDir: binDir}
}

// Replica is one sidecar process.
type Replica struct {
	Name   string
	Socket string
	Driver *testdriver.Server
	// ExitCode and ExitedAt are set once Done is closed.
	ExitCode int
	ExitedAt time.Time
	Done     chan struct{}

	health string
	cmd    *exec.Cmd
	stderr *lockedBuffer
}

// Start runs command (a binary in BinDir and its subcommand, for example "csi-sidecars",
// "attacher") as replica name, with its own driver socket and these shared flags before
// extra: --csi-address, --kubeconfig (admin), --leader-election in the scenario's namespace
// with identity name, --http-endpoint on a free port, -v=2. Lease timings are long on
// purpose (30s/20s/10s): a replica that polled instead of watching would need a retry
// period (10 s) to take over, which takeover assertions catch. extra may override any.
func (s *Scenario) Start(name string, command []string, extra ...string) *Replica {
	s.T.Helper()
	return s.start(name, filepath.Join(s.BinDir, command[0]), "", command[1:], append([]string{"--leader-election-identity=" + name}, extra...))
}

// StartUpstream runs an upstream sidecar's binary (a path, such as one internal/testkit/upstream
// built) as replica name with Start's shared flags but the identity, which upstream's
// sidecars do not have (theirs is the host name): upstream's flags keep these names.
func (s *Scenario) StartUpstream(name, binary string, extra ...string) *Replica {
	s.T.Helper()
	return s.start(name, binary, "", nil, extra)
}

// setHostname is a shell script that names its UTS namespace $0 and then runs its
// arguments in its place.
const setHostname = `echo "$0" > /proc/sys/kernel/hostname && exec "$@"`

// StartUpstreamAs is StartUpstream in a UTS namespace of its own whose host name is host, as
// in a pod of that name: upstream's sidecars take their leader-election identity from the
// host name, so two replicas on one machine would otherwise share one identity and both
// lead. The process is the upstream binary itself (the shell execs it), so signals reach it.
// It needs what HostNames checks.
func (s *Scenario) StartUpstreamAs(name, host, binary string, extra ...string) *Replica {
	s.T.Helper()
	return s.start(name, binary, host, nil, extra)
}

// HostNames tells whether StartUpstreamAs can run here: nil when a child process may have a
// UTS namespace and a host name of its own (root, or CAP_SYS_ADMIN, and a writable
// /proc/sys), else why not.
func HostNames() error {
	cmd := exec.Command("/bin/sh", "-c", setHostname, "csi-sidecars-probe", "cat", "/proc/sys/kernel/hostname")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUTS}
	out, err := cmd.CombinedOutput()
	got := strings.TrimSpace(string(out))
	switch {
	case err != nil:
		return fmt.Errorf("e2e: no host name of its own for a replica (a UTS namespace needs CAP_SYS_ADMIN and a writable /proc/sys): %w: %s", err, got)
	case got != "csi-sidecars-probe":
		return fmt.Errorf("e2e: a replica's host name did not take: it is %q", got)
	}
	return nil
}

// start runs binary with lead, the shared flags and then extra as its arguments, under
// host name host when it is set (Command.Host).
func (s *Scenario) start(name, binary, host string, lead, extra []string) *Replica {
	s.T.Helper()
	return s.launch(name, func(ep Endpoints) Command {
		shared := []string{
			"--csi-address=" + ep.CSI,
			"--kubeconfig=" + ep.Kubeconfig,
			"--leader-election",
			"--leader-election-namespace=" + s.Namespace,
			"--leader-election-lease-duration=30s",
			"--leader-election-renew-deadline=20s",
			"--leader-election-retry-period=10s",
			"--http-endpoint=" + ep.HTTP,
			"-v=2",
		}
		return Command{Binary: binary, Args: append(append(append([]string{}, lead...), shared...), extra...), Host: host}
	})
}

// Endpoints are what the harness has for a replica before it starts: its own socket on
// the scenario's driver, a free diagnostics address and the control plane's kubeconfig.
type Endpoints struct {
	// CSI is the replica's driver socket as --csi-address takes it (unix://...); Socket
	// is its path.
	CSI, Socket string
	// HTTP is 127.0.0.1:<a free port>, where Replica.Get and WaitReady look.
	HTTP string
	// Kubeconfig is the control plane's admin kubeconfig.
	Kubeconfig string
}

// Command is a replica's process as StartCommand runs it.
type Command struct {
	// Binary is a file of BinDir ("csi-sidecars") or a path.
	Binary string
	Args   []string
	// Env is added to the test's environment ("NAME=value").
	Env []string
	// Host, when set, gives the process a UTS namespace of its own with this host name,
	// as in a pod of that name (see StartUpstreamAs, HostNames).
	Host string
}

// StartCommand runs the replica command returns, given the replica's endpoints, with none
// of Start's shared flags: for the args of a manifest's container, of which a test
// substitutes only what must differ outside a cluster (the socket, the kubeconfig, ports).
func (s *Scenario) StartCommand(name string, command func(Endpoints) Command) *Replica {
	s.T.Helper()
	return s.launch(name, func(ep Endpoints) Command {
		c := command(ep)
		if !filepath.IsAbs(c.Binary) {
			c.Binary = filepath.Join(s.BinDir, c.Binary)
		}
		return c
	})
}

// launch serves the replica's socket and runs the process command returns for its
// endpoints; with a Host, in a UTS namespace of its own that the shell names and then
// execs the binary in (so signals reach the binary itself).
func (s *Scenario) launch(name string, command func(Endpoints) Command) *Replica {
	s.T.Helper()
	srv, err := s.Driver.Serve(filepath.Join(s.Dir, name+".sock"))
	if err != nil {
		s.T.Fatal(err)
	}
	s.T.Cleanup(srv.Stop)
	port := FreePort(s.T)
	c := command(Endpoints{CSI: srv.Endpoint(), Socket: srv.Socket(), HTTP: "127.0.0.1:" + port, Kubeconfig: s.CP.KubeconfigPath()})
	var namespaces uintptr
	if c.Host != "" {
		c.Binary, c.Args = "/bin/sh", append([]string{"-c", setHostname, c.Host, c.Binary}, c.Args...)
		namespaces = syscall.CLONE_NEWUTS
	}
	r := &Replica{Name: name, Socket: srv.Socket(), Driver: srv, health: "http://127.0.0.1:" + port, stderr: &lockedBuffer{}, Done: make(chan struct{})}
	r.cmd = exec.Command(c.Binary, c.Args...)
	if len(c.Env) > 0 {
		r.cmd.Env = append(os.Environ(), c.Env...)
	}
	logFile, err := os.Create(filepath.Join(s.Dir, name+".log"))
	if err != nil {
		s.T.Fatal(err)
	}
	r.cmd.Stdout = logFile
	r.cmd.Stderr = io.MultiWriter(logFile, r.stderr)
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Cloneflags: namespaces}
	if err := r.cmd.Start(); err != nil {
		s.T.Fatal(err)
	}
	go func() {
		_ = r.cmd.Wait()
		r.ExitedAt = time.Now()
		r.ExitCode = r.cmd.ProcessState.ExitCode()
		logFile.Close()
		close(r.Done)
	}()
	s.T.Cleanup(func() {
		_ = r.cmd.Process.Kill()
		<-r.Done
		if s.T.Failed() {
			s.T.Logf("--- log of %s ---\n%s", name, r.stderr.String())
		}
	})
	return r
}

// Signal sends sig to the replica and returns when it was sent.
func (r *Replica) Signal(t testing.TB, sig syscall.Signal) time.Time {
	t.Helper()
	at := time.Now()
	if err := r.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signalling %s: %v", r.Name, err)
	}
	return at
}

// Wait waits for the replica to exit and returns its exit code.
func (r *Replica) Wait(t testing.TB, timeout time.Duration) int {
	t.Helper()
	select {
	case <-r.Done:
		return r.ExitCode
	case <-time.After(timeout):
		t.Fatalf("%s did not exit within %v", r.Name, timeout)
		return -1
	}
}

// Running tells whether the process is still running.
func (r *Replica) Running() bool {
	select {
	case <-r.Done:
		return false
	default:
		return true
	}
}

// Stderr is what the replica logged so far.
func (r *Replica) Stderr() string { return r.stderr.String() }

// WaitReady waits until /readyz answers 200: the replica is connected, set up, and its
// caches are synced.
func (r *Replica) WaitReady(t testing.TB) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		if !r.Running() {
			return false, fmt.Errorf("%s exited with %d", r.Name, r.ExitCode)
		}
		code, _ := r.Get("/readyz")
		return code == http.StatusOK, nil
	})
	if err != nil {
		t.Fatalf("%s not ready: %v\n%s", r.Name, err, r.stderr.String())
	}
}

// Get fetches path from the replica's diagnostics server.
func (r *Replica) Get(path string) (int, string) {
	resp, err := http.Get(r.health + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// Lease gets a Lease of the scenario's namespace.
func (s *Scenario) Lease(name string) *coordinationv1.Lease {
	s.T.Helper()
	l, err := s.Client.CoordinationV1().Leases(s.Namespace).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		s.T.Fatalf("getting the Lease: %v", err)
	}
	return l
}

// Holder is a Lease's holder identity, "" when released.
func Holder(l *coordinationv1.Lease) string {
	if l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

// WaitForHolder waits until Lease name is held by want.
func (s *Scenario) WaitForHolder(name, want string) {
	s.T.Helper()
	s.WaitUntil(fmt.Sprintf("Lease %s is held by %q", name, want), func() bool {
		l, err := s.Client.CoordinationV1().Leases(s.Namespace).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && Holder(l) == want
	})
}

// WaitForRunningHolder waits until Lease name is held by one of replicas (by identity)
// whose process runs, and returns its identity.
func (s *Scenario) WaitForRunningHolder(name string, replicas map[string]*Replica) string {
	s.T.Helper()
	var id string
	s.WaitUntil(fmt.Sprintf("Lease %s held by a running replica", name), func() bool {
		l, err := s.Client.CoordinationV1().Leases(s.Namespace).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		id = Holder(l)
		r := replicas[id]
		return r != nil && r.Running()
	})
	return id
}

// MeanAndLongest are the mean and the longest of ds in seconds (0, 0 for none): a chaos
// run's figures of time to converge.
func MeanAndLongest(ds []time.Duration) (mean, longest float64) {
	if len(ds) == 0 {
		return 0, 0
	}
	var sum time.Duration
	for _, d := range ds {
		sum += d
		longest = max(longest, d.Seconds())
	}
	return sum.Seconds() / float64(len(ds)), longest
}

// WaitForCalls waits until the driver's journal satisfies cond.
func (s *Scenario) WaitForCalls(what string, cond func([]testdriver.Call) bool) {
	s.T.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := s.Driver.WaitFor(ctx, cond); err != nil {
		s.T.Fatalf("waiting for %s: %v", what, err)
	}
}

// WaitUntil polls cond, for state with no API of its own to wait on, until it holds or
// 60 s pass.
func (s *Scenario) WaitUntil(what string, cond func() bool) {
	s.T.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		return cond(), nil
	})
	if err != nil {
		s.T.Fatalf("waiting until %s: %v", what, err)
	}
}

// CallsOn returns the calls of method received on a replica's socket.
func CallsOn(calls []testdriver.Call, r *Replica, method string) []testdriver.Call {
	var out []testdriver.Call
	for _, c := range calls {
		if c.Socket == r.Socket && c.Method == method {
			out = append(out, c)
		}
	}
	return out
}

// Running counts the calls whose backend operation still runs.
func Running(calls []testdriver.Call) int {
	n := 0
	for _, c := range calls {
		if !c.Done() {
			n++
		}
	}
	return n
}

// FreePort returns a TCP port free on 127.0.0.1 a moment ago.
func FreePort(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	return port
}

// ExitCode is the exit code in an exec error (0 for nil, -1 if it did not run).
func ExitCode(err error) int {
	if err == nil {
		return 0
	}
	var e *exec.ExitError
	if errors.As(err, &e) {
		return e.ExitCode()
	}
	return -1
}

// WriteKubeconfig writes a kubeconfig for server (which may not be there) into dir.
func WriteKubeconfig(t testing.TB, dir, server string) string {
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
