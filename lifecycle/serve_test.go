package lifecycle

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/spf13/pflag"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// probingServer is a Server that, once the driver told its name, makes one Probe on Ops()
// for each value sent on calls and reports its result on results: a registration call or
// a liveness probe in miniature.
type probingServer struct {
	name    string
	calls   chan struct{}
	started chan struct{}
	results chan error
	// returnEarly makes Serve return as soon as the driver told its name.
	returnEarly bool
	// nothingToServe makes Serve return ErrNothingToServe at once.
	nothingToServe bool
}

func newProbingServer(name string) *probingServer {
	return &probingServer{name: name, calls: make(chan struct{}), started: make(chan struct{}, 10), results: make(chan error, 10)}
}

func (s *probingServer) Name() string              { return s.name }
func (s *probingServer) AddFlags(_ *pflag.FlagSet) {}

func (s *probingServer) Serve(intake context.Context, env *ServerEnv) error {
	if s.nothingToServe {
		return ErrNothingToServe
	}
	if _, err := env.DriverName(intake); err != nil {
		return nil // stopped before the driver answered
	}
	if s.returnEarly {
		return nil
	}
	pending := make(chan struct{}, 10)
	for {
		select {
		case <-s.calls:
			pending <- struct{}{}
			go func() {
				s.started <- struct{}{}
				_, err := csi.NewIdentityClient(env.CSI).Probe(env.Ops(), &csi.ProbeRequest{})
				s.results <- err
				<-pending
			}()
		case <-intake.Done():
			// What was asked before the signal ends; nothing new is taken.
			for len(pending) > 0 {
				time.Sleep(time.Millisecond)
			}
			return nil
		}
	}
}

// serverProcess runs servers in-process against a test driver, with no API server and no
// kubeconfig.
type serverProcess struct {
	backend *testdriver.Backend
	driver  *testdriver.Server
	socket  string
	signals chan os.Signal
	exitNow chan int
	exited  chan int
}

func startServerProcess(t *testing.T, drainTimeout time.Duration, servers ...Hosted) *serverProcess {
	t.Helper()
	backend, err := testdriver.New(testdriver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	p := &serverProcess{backend: backend, socket: filepath.Join(t.TempDir(), "csi.sock"),
		signals: make(chan os.Signal, 2), exitNow: make(chan int, 1), exited: make(chan int, 1)}
	if p.driver, err = backend.Serve(p.socket); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.driver.Stop() })
	opts := NewOptions()
	opts.Getenv = func(string) string { return "" }
	opts.CSIAddress = p.socket
	opts.DrainTimeout = drainTimeout
	if err := opts.Validate(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.exited <- RunWithSignals(t.Context(), opts, p.signals, func(code int) { p.exitNow <- code }, servers...)
	}()
	return p
}

func (p *serverProcess) exitCode(t *testing.T) int {
	t.Helper()
	select {
	case code := <-p.exited:
		return code
	case <-t.Context().Done():
		t.Fatal("the process did not exit")
		return -1
	}
}

// P1, P2 for a sidecar without a Lease: the first signal ends intake, the call in the
// driver finishes on Ops() (not cancelled by the signal), and the process exits 0. No
// kubeconfig and no API server are needed.
func TestAServerFinishesItsCallAfterTheFirstSignalAndExits0(t *testing.T) {
	srv := newProbingServer("probe")
	p := startServerProcess(t, time.Minute, srv)
	release := p.backend.Hold(testdriver.MethodProbe)
	srv.calls <- struct{}{}
	<-srv.started
	p.signals <- syscall.SIGTERM
	release()
	if err := <-srv.results; err != nil {
		t.Errorf("the call in flight at the signal: %v, want it to finish", err)
	}
	if code := p.exitCode(t); code != ExitOK {
		t.Errorf("exit code %d, want %d", code, ExitOK)
	}
}

// P3: the drain deadline cancels what is still in the driver and exits non-zero.
func TestAServerCallStillRunningAtTheDrainDeadlineIsCancelled(t *testing.T) {
	srv := newProbingServer("probe")
	p := startServerProcess(t, 100*time.Millisecond, srv)
	release := p.backend.Hold(testdriver.MethodProbe)
	defer release()
	srv.calls <- struct{}{}
	<-srv.started
	p.signals <- syscall.SIGTERM
	if err := <-srv.results; status.Code(err) != codes.Canceled {
		t.Errorf("the call at the drain deadline: %v, want it cancelled", err)
	}
	if code := p.exitCode(t); code != ExitError {
		t.Errorf("exit code %d, want %d", code, ExitError)
	}
}

// P5: a second signal exits at once, non-zero.
func TestASecondSignalExitsAServerProcessAtOnce(t *testing.T) {
	srv := newProbingServer("probe")
	p := startServerProcess(t, time.Minute, srv)
	release := p.backend.Hold(testdriver.MethodProbe)
	defer release()
	srv.calls <- struct{}{}
	<-srv.started
	p.signals <- syscall.SIGTERM
	p.signals <- syscall.SIGINT
	if code := <-p.exitNow; code != ExitError {
		t.Errorf("immediate exit with %d, want %d", code, ExitError)
	}
}

// A Server that ends on its own (upstream's registrar told by the kubelet that the
// registration failed) ends the process non-zero; the other Servers drain.
func TestAServerThatEndsOnItsOwnStopsTheProcessNonZero(t *testing.T) {
	quitter := newProbingServer("quitter")
	quitter.returnEarly = true
	other := newProbingServer("other")
	p := startServerProcess(t, time.Minute, quitter, other)
	if code := p.exitCode(t); code != ExitError {
		t.Errorf("exit code %d, want %d", code, ExitError)
	}
}

// A Server whose flags ask for nothing (upstream's one-shot modes) exits 0 at once, without
// waiting for a driver that may not be there.
func TestAServerWithNothingToServeExits0(t *testing.T) {
	srv := newProbingServer("oneshot")
	srv.nothingToServe = true
	opts := NewOptions()
	opts.Getenv = func(string) string { return "" }
	opts.CSIAddress = filepath.Join(t.TempDir(), "nobody.sock")
	if err := opts.Validate(); err != nil {
		t.Fatal(err)
	}
	if code := RunWithSignals(t.Context(), opts, nil, func(int) { t.Error("exited at once") }, srv); code != ExitOK {
		t.Errorf("exit code %d, want %d", code, ExitOK)
	}
}

// A driver that restarts (its container restarted by its liveness probe) is dialled again:
// a Server's calls work again, and the process goes on.
func TestAServerCallsARestartedDriverAgain(t *testing.T) {
	srv := newProbingServer("probe")
	p := startServerProcess(t, time.Minute, srv)
	srv.calls <- struct{}{}
	<-srv.started
	if err := <-srv.results; err != nil {
		t.Fatalf("first call: %v", err)
	}
	p.driver.Stop()
	var err error
	if p.driver, err = p.backend.Serve(p.socket); err != nil {
		t.Fatal(err)
	}
	// Calls may fail while gRPC notices the restart; one succeeds once it dialled again.
	for {
		srv.calls <- struct{}{}
		<-srv.started
		if err := <-srv.results; err == nil {
			break
		} else if status.Code(err) != codes.Unavailable {
			t.Fatalf("call after the driver restarted: %v, want Unavailable until it is dialled again", err)
		}
		select {
		case code := <-p.exited:
			t.Fatalf("the process exited with %d when the driver restarted", code)
		case <-time.After(50 * time.Millisecond):
		}
	}
	p.signals <- syscall.SIGTERM
	if code := p.exitCode(t); code != ExitOK {
		t.Errorf("exit code %d, want %d", code, ExitOK)
	}
}

// A Server started before its driver waits for it, and a signal meanwhile ends it cleanly.
func TestAServerWaitingForItsDriverStopsCleanly(t *testing.T) {
	srv := newProbingServer("probe")
	opts := NewOptions()
	opts.Getenv = func(string) string { return "" }
	opts.CSIAddress = filepath.Join(t.TempDir(), "nobody.sock")
	if err := opts.Validate(); err != nil {
		t.Fatal(err)
	}
	signals := make(chan os.Signal, 1)
	signals <- syscall.SIGTERM
	code := RunWithSignals(t.Context(), opts, signals, func(int) { t.Error("exited at once") }, srv)
	if code != ExitOK {
		t.Errorf("exit code %d, want %d", code, ExitOK)
	}
	if errors.Is(t.Context().Err(), context.Canceled) {
		t.Fatal("test context ended")
	}
}
