package registrar

import (
	"context"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

const kubeletPath = "/var/lib/kubelet/plugins/test.csi.sidecars.io/csi.sock"

// node is a node's folders as a registrar sees them, with a test CSI driver.
type node struct {
	backend *testdriver.Backend
	driver  string // its socket
	regDir  string
}

func newNode(t *testing.T) *node {
	t.Helper()
	// Short: a UNIX socket's path has at most 107 bytes.
	dir, err := os.MkdirTemp("", "reg")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	backend, err := testdriver.New(testdriver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	n := &node{backend: backend, driver: filepath.Join(dir, "csi.sock"), regDir: filepath.Join(dir, "registry")}
	if err := os.Mkdir(n.regDir, 0o750); err != nil {
		t.Fatal(err)
	}
	srv, err := backend.Serve(n.driver)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return n
}

// socket is where the registrar of the test driver places its registration socket.
func (n *node) socket() string {
	return filepath.Join(n.regDir, testdriver.DefaultDriverName+"-reg.sock")
}

// registrarProcess is one registrar hosted by the core in the test process, as one pod's
// container would run it.
type registrarProcess struct {
	signals chan os.Signal
	exited  chan int
}

func (n *node) start(t *testing.T, configure ...func(*Sidecar)) *registrarProcess {
	t.Helper()
	s := New()
	s.kubeletRegistrationPath = kubeletPath
	s.pluginRegistrationPath = n.regDir
	s.checkEvery = 20 * time.Millisecond
	for _, c := range configure {
		c(s)
	}
	opts := lifecycle.NewOptions()
	opts.Getenv = func(string) string { return "" }
	opts.CSIAddress = n.driver
	if err := opts.Validate(); err != nil {
		t.Fatal(err)
	}
	p := &registrarProcess{signals: make(chan os.Signal, 2), exited: make(chan int, 1)}
	go func() {
		p.exited <- lifecycle.RunWithSignals(context.WithoutCancel(t.Context()), opts, p.signals, func(code int) { t.Errorf("exited at once with %d", code) }, s)
	}()
	t.Cleanup(func() {
		select {
		case p.signals <- syscall.SIGTERM:
		default:
		}
		<-p.exited
	})
	return p
}

// stop sends SIGTERM and returns the exit code.
func (p *registrarProcess) stop(t *testing.T) int {
	t.Helper()
	p.signals <- syscall.SIGTERM
	select {
	case code := <-p.exited:
		p.exited <- code // for the cleanup
		return code
	case <-t.Context().Done():
		t.Fatal("the registrar did not exit")
		return -1
	}
}

// kubelet is the kubelet's side of one registration: it dials the socket and calls GetInfo,
// then reports the status on the same connection, as the kubelet's plugin manager does.
type kubelet struct {
	conn   *grpc.ClientConn
	client registerapi.RegistrationClient
}

func dialKubelet(t *testing.T, socket string) *kubelet {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &kubelet{conn: conn, client: registerapi.NewRegistrationClient(conn)}
}

func (k *kubelet) getInfo(ctx context.Context) (*registerapi.PluginInfo, error) {
	return k.client.GetInfo(ctx, &registerapi.InfoRequest{})
}

func (k *kubelet) notify(ctx context.Context, registered bool) error {
	_, err := k.client.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: registered})
	return err
}

// waitFor polls cond until it holds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-t.Context().Done():
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// answers tells whether the socket at path answers GetInfo with the driver's name.
func answers(t *testing.T, path string) bool {
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return false
	}
	defer conn.Close()
	info, err := registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{}, grpc.WaitForReady(false))
	return err == nil && info.GetName() == testdriver.DefaultDriverName
}

func fileOf(t *testing.T, path string) os.FileInfo {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi
}

// A dead process's socket file: nothing listens on it.
func staleSocket(t *testing.T, path string) {
	t.Helper()
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
}

func TestTheSocketAnswersWhatUpstreamAnswers(t *testing.T) {
	n := newNode(t)
	n.start(t)
	waitFor(t, "the registration socket", func() bool { return answers(t, n.socket()) })
	info, err := dialKubelet(t, n.socket()).getInfo(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != registerapi.CSIPlugin || info.Name != testdriver.DefaultDriverName || info.Endpoint != kubeletPath ||
		len(info.SupportedVersions) != 1 || info.SupportedVersions[0] != "1.0.0" {
		t.Errorf("GetInfo = %+v, want a CSIPlugin %s at %s, versions [1.0.0]", info, testdriver.DefaultDriverName, kubeletPath)
	}
	if mode := fileOf(t, n.socket()).Mode(); mode&fs.ModeSocket == 0 || mode.Perm() != 0o700 {
		t.Errorf("socket mode %v, want a socket with 0700, as upstream's", mode)
	}
}

// Upstream removes its socket on SIGTERM, and the kubelet takes the driver out of the
// node's CSINode until the next pod registers it. Here the socket stays, and a registration
// the kubelet runs at the signal ends: its status report, on the connection it asked
// GetInfo on, still reaches the registrar (the kubelet unregisters the driver when it
// cannot report).
func TestASignalLeavesTheSocketAndLetsTheRegistrationInFlightReport(t *testing.T) {
	n := newNode(t)
	p := n.start(t)
	waitFor(t, "the registration socket", func() bool { return answers(t, n.socket()) })
	placed := fileOf(t, n.socket())
	k := dialKubelet(t, n.socket())
	if _, err := k.getInfo(t.Context()); err != nil {
		t.Fatal(err)
	}
	p.signals <- syscall.SIGTERM
	// The kubelet is still calling the driver's NodeGetInfo; then it reports.
	if err := k.notify(t.Context(), true); err != nil {
		t.Errorf("the kubelet's report after the signal: %v, want it received", err)
	}
	if code := <-p.exited; code != lifecycle.ExitOK {
		t.Errorf("exit code %d, want 0", code)
	}
	p.exited <- 0
	if !os.SameFile(fileOf(t, n.socket()), placed) {
		t.Error("the registration socket was removed or replaced on SIGTERM; it must stay for the kubelet")
	}
}

// Upstream removes any socket it finds at start, also one that another registrar serves
// (two pods on one node, a maxSurge rollout), which takes the driver out of CSINode and
// leaves the other one serving an unlinked file. A socket somebody serves is never
// replaced here; one that nobody serves is replaced in one step.
func TestALiveSocketIsLeftToItsServerAndAStaleOneIsReplaced(t *testing.T) {
	n := newNode(t)
	foreign, err := net.ListenUnix("unix", &net.UnixAddr{Name: n.socket(), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	foreign.SetUnlinkOnClose(false)
	theirs := fileOf(t, n.socket())
	n.start(t)
	waitFor(t, "the registrar to ask the driver its name", func() bool { return len(n.backend.Calls(testdriver.MethodGetPluginInfo)) > 0 })
	// Fifty of its checks.
	for range 50 {
		if !os.SameFile(fileOf(t, n.socket()), theirs) {
			t.Fatal("the registrar replaced a socket another process serves")
		}
		time.Sleep(20 * time.Millisecond)
	}
	foreign.Close() // that process ends; its file stays
	waitFor(t, "the stale socket to be replaced", func() bool { return answers(t, n.socket()) })
}

func TestAStaleSocketAtStartIsReplaced(t *testing.T) {
	n := newNode(t)
	staleSocket(t, n.socket())
	n.start(t)
	waitFor(t, "the stale socket to be replaced", func() bool { return answers(t, n.socket()) })
}

func TestAFileThatIsNotASocketIsRefused(t *testing.T) {
	n := newNode(t)
	if err := os.WriteFile(n.socket(), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := n.start(t)
	if code := <-p.exited; code != lifecycle.ExitError {
		t.Errorf("exit code %d, want %d", code, lifecycle.ExitError)
	}
	p.exited <- 0
	if b, err := os.ReadFile(n.socket()); err != nil || string(b) != "x" {
		t.Errorf("the file was changed: %q, %v", b, err)
	}
}

// A socket another process removed (upstream's registrar of an old pod, a person) is
// placed again within seconds, so the kubelet registers the driver again.
func TestASocketRemovedByAnotherProcessIsPlacedAgain(t *testing.T) {
	n := newNode(t)
	n.start(t)
	waitFor(t, "the registration socket", func() bool { return answers(t, n.socket()) })
	if err := os.Remove(n.socket()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the socket to be placed again", func() bool { return answers(t, n.socket()) })
	// And a stale file put in its place is replaced too.
	if err := os.Remove(n.socket()); err != nil {
		t.Fatal(err)
	}
	staleSocket(t, n.socket())
	waitFor(t, "the stale replacement to be replaced", func() bool { return answers(t, n.socket()) })
}

// Two registrars on one node (a maxSurge rollout, or the DaemonSet controller starting a
// second pod): the second waits beside the first, and is handed the very socket when the
// first stops, so the file the kubelet registered never changes. Then the second stops and
// leaves it in place.
func TestTheNextRegistrarIsHandedTheSocketAndTheFileNeverChanges(t *testing.T) {
	n := newNode(t)
	first := n.start(t)
	waitFor(t, "the registration socket", func() bool { return answers(t, n.socket()) })
	placed := fileOf(t, n.socket())
	second := n.start(t)
	waitFor(t, "the second registrar to wait beside the first", func() bool { return len(n.backend.Calls(testdriver.MethodGetPluginInfo)) >= 2 })
	// It connects to the hidden socket once it saw the live one; a registration right
	// after the first stopped reaches the second.
	time.Sleep(100 * time.Millisecond)
	if code := first.stop(t); code != lifecycle.ExitOK {
		t.Errorf("first exit code %d, want 0", code)
	}
	if !answers(t, n.socket()) {
		t.Error("nobody answers on the socket after the first registrar stopped")
	}
	if !os.SameFile(fileOf(t, n.socket()), placed) {
		t.Error("the socket file changed at the handover; the kubelet would register the driver again")
	}
	if code := second.stop(t); code != lifecycle.ExitOK {
		t.Errorf("second exit code %d, want 0", code)
	}
	if !os.SameFile(fileOf(t, n.socket()), placed) {
		t.Error("the socket file was removed when the second stopped")
	}
}

// The kubelet reports that registering failed: upstream exits 1 for the kubelet to restart
// it.
func TestAFailedRegistrationExits1(t *testing.T) {
	n := newNode(t)
	p := n.start(t)
	waitFor(t, "the registration socket", func() bool { return answers(t, n.socket()) })
	k := dialKubelet(t, n.socket())
	if _, err := k.getInfo(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := k.notify(t.Context(), false); err != nil {
		t.Fatal(err)
	}
	if code := <-p.exited; code != lifecycle.ExitError {
		t.Errorf("exit code %d, want %d", code, lifecycle.ExitError)
	}
	p.exited <- 0
}

func TestKubeletRegistrationProbeModeExits0AtOnce(t *testing.T) {
	n := newNode(t)
	p := n.start(t, func(s *Sidecar) { s.mode = modeRegistrationProbe })
	if code := <-p.exited; code != lifecycle.ExitOK {
		t.Errorf("exit code %d, want 0", code)
	}
	p.exited <- 0
	if _, err := os.Lstat(n.socket()); err == nil {
		t.Error("a registration probe placed a socket")
	}
}
