package upstreamregistrar

import (
	"bytes"
	"context"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

const endpoint = "/var/lib/kubelet/plugins/test/csi.sock"

// model is one Run of the model in the test process.
type model struct {
	cfg     Config
	path    string
	sigterm chan chan<- os.Signal // the channel Run catches SIGTERM on, once it listens
	exited  chan int
	log     *syncBuffer
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func newConfig(t *testing.T) Config {
	t.Helper()
	dir, err := os.MkdirTemp("", "upreg")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	b, err := testdriver.New(testdriver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := b.Serve(filepath.Join(dir, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	reg := filepath.Join(dir, "registry")
	if err := os.Mkdir(reg, 0o750); err != nil {
		t.Fatal(err)
	}
	return Config{CSIAddress: srv.Endpoint(), KubeletRegistrationPath: endpoint, PluginRegistrationPath: reg, Timeout: time.Second}
}

func start(t *testing.T, cfg Config) *model {
	t.Helper()
	m := &model{cfg: cfg, path: cfg.SocketPath(testdriver.DefaultDriverName), sigterm: make(chan chan<- os.Signal, 1), exited: make(chan int, 1), log: &syncBuffer{}}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		m.exited <- Run(ctx, cfg, m.log, func(c chan<- os.Signal) { m.sigterm <- c })
	}()
	t.Cleanup(func() {
		cancel()
		<-m.exited
	})
	return m
}

// listening waits until the model has caught SIGTERM, that is, listens.
func (m *model) listening(t *testing.T) chan<- os.Signal {
	t.Helper()
	select {
	case c := <-m.sigterm:
		return c
	case code := <-m.exited:
		t.Fatalf("exited with %d before listening: %s", code, m.log.String())
	case <-time.After(30 * time.Second):
		t.Fatal("not listening after 30s")
	}
	return nil
}

func (m *model) exitCode(t *testing.T) int {
	t.Helper()
	select {
	case code := <-m.exited:
		m.exited <- code // for the cleanup
		return code
	case <-time.After(30 * time.Second):
		t.Fatal("did not exit")
		return -1
	}
}

func registrationClient(t *testing.T, path string) registerapi.RegistrationClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return registerapi.NewRegistrationClient(conn)
}

func TestItReplacesALiveSocketAndAnswersAsUpstream(t *testing.T) {
	cfg := newConfig(t)
	path := cfg.SocketPath(testdriver.DefaultDriverName)
	other, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	before, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	m := start(t, cfg)
	m.listening(t)
	after, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if os.SameFile(before, after) {
		t.Error("the socket another process served is still in place")
	}
	if perm := after.Mode().Perm(); perm != 0o700 {
		t.Errorf("socket mode %v, want 0700", perm)
	}
	info, err := registrationClient(t, path).GetInfo(t.Context(), &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetType() != registerapi.CSIPlugin || info.GetName() != testdriver.DefaultDriverName || info.GetEndpoint() != endpoint ||
		len(info.GetSupportedVersions()) != 1 || info.GetSupportedVersions()[0] != "1.0.0" {
		t.Errorf("GetInfo = %+v", info)
	}
}

func TestSIGTERMRemovesTheSocketAndExits0(t *testing.T) {
	m := start(t, newConfig(t))
	m.listening(t) <- syscall.SIGTERM
	if code := m.exitCode(t); code != 0 {
		t.Errorf("exit code %d, want 0", code)
	}
	if _, err := os.Lstat(m.path); !os.IsNotExist(err) {
		t.Errorf("socket after SIGTERM: %v, want removed", err)
	}
}

func TestAFailedRegistrationExits1AndLeavesTheSocket(t *testing.T) {
	m := start(t, newConfig(t))
	m.listening(t)
	_, err := registrationClient(t, m.path).NotifyRegistrationStatus(t.Context(), &registerapi.RegistrationStatus{PluginRegistered: false, Error: "no"})
	if err == nil {
		t.Error("NotifyRegistrationStatus(false) answered; upstream's process ends under it")
	}
	if code := m.exitCode(t); code != 1 {
		t.Errorf("exit code %d, want 1", code)
	}
	if fi, err := os.Lstat(m.path); err != nil || fi.Mode()&fs.ModeSocket == 0 {
		t.Errorf("socket after a failed registration: %v, want left in place", err)
	}
}

func TestAFileThatIsNotASocketExits1(t *testing.T) {
	cfg := newConfig(t)
	path := cfg.SocketPath(testdriver.DefaultDriverName)
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if code := start(t, cfg).exitCode(t); code != 1 {
		t.Errorf("exit code %d, want 1", code)
	}
	if fi, err := os.Lstat(path); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("the file: %v, want left as it was", err)
	}
}

func TestTheKubeletRegistrationPathIsRequired(t *testing.T) {
	cfg, code, err := ParseFlags([]string{"--csi-address=/nowhere"}, &bytes.Buffer{})
	if err != nil || code != 0 {
		t.Fatalf("ParseFlags: %d, %v", code, err)
	}
	if code := start(t, cfg).exitCode(t); code != 1 {
		t.Errorf("exit code %d, want 1", code)
	}
	if _, code, _ := ParseFlags([]string{"--no-such-flag"}, &bytes.Buffer{}); code != 2 {
		t.Errorf("an unknown flag: exit code %d, want 2", code)
	}
}
