package controlplane

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"
)

// SkipEnv, set to "1", makes Shared skip the tests that need a control plane
// instead of starting one, for quick local runs of the unit tests.
const SkipEnv = "CSI_SIDECARS_SKIP_CONTROLPLANE"

// sharedStartTimeout bounds Start in Shared.Main; readiness alone is bounded
// by Options.ReadyTimeout, this also covers port retries.
const sharedStartTimeout = 3 * time.Minute

// Shared is one control plane for a whole test package, started by TestMain:
//
//	var kube controlplane.Shared
//
//	func TestMain(m *testing.M) { os.Exit(kube.Main(m, controlplane.Options{})) }
//
//	func TestSomething(t *testing.T) {
//		cp := kube.Get(t)
//		client := kubernetes.NewForConfigOrDie(cp.Config())
//		...
//	}
//
// The control plane is shared, so tests should use their own namespaces (or
// unique names) rather than assume an empty cluster.
type Shared struct {
	cp         *ControlPlane
	skipReason string
}

// Main starts the control plane, runs the tests, stops it and returns the
// exit code for os.Exit. Missing binaries or a failed start fail the package
// (exit code 1, error on stderr) rather than skipping it, so CI cannot go
// green without having run anything; only CSI_SIDECARS_SKIP_CONTROLPLANE=1
// skips, and then the tests run and Get skips those that need the control
// plane.
func (s *Shared) Main(m *testing.M, opts Options) int {
	if os.Getenv(SkipEnv) == "1" {
		s.skipReason = SkipEnv + "=1: not starting kube-apiserver and etcd"
		fmt.Fprintf(os.Stderr, "controlplane: %s; tests that need them are skipped\n", s.skipReason)
		return m.Run()
	}

	// m.Run would parse the flags too, but testing.Verbose below needs them
	// now (it panics before Parse).
	if !flag.Parsed() {
		flag.Parse()
	}
	if testing.Short() {
		s.skipReason = "-short: not starting kube-apiserver and etcd"
		return m.Run()
	}

	ctx, cancel := context.WithTimeout(context.Background(), sharedStartTimeout)
	began := time.Now()
	cp, err := Start(ctx, opts)
	cancel()
	if err != nil {
		fmt.Fprintf(os.Stderr, "controlplane: %v\n(set %s=1 to skip tests that need a control plane)\n", err, SkipEnv)
		return 1
	}
	if testing.Verbose() {
		fmt.Fprintf(os.Stderr, "controlplane: kube-apiserver ready at %s after %s (logs in %s)\n",
			cp.URL(), time.Since(began).Round(10*time.Millisecond), cp.LogDir())
	}
	s.cp = cp

	// Pdeathsig already kills the children if the test binary dies, but only
	// a clean Stop removes the temporary directory; do that on Ctrl-C too.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	finished := make(chan struct{})
	defer close(finished)
	go func() {
		select {
		case sig := <-sigs:
			_ = cp.Stop()
			fmt.Fprintf(os.Stderr, "controlplane: stopped on %v\n", sig)
			os.Exit(2)
		case <-finished:
		}
	}()

	code := m.Run()
	if err := cp.Stop(); err != nil {
		fmt.Fprintf(os.Stderr, "controlplane: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// Get returns the shared control plane, or skips t when it was not started
// because of CSI_SIDECARS_SKIP_CONTROLPLANE=1. Calling it without Main having
// started one is a bug in the test package and fails t.
func (s *Shared) Get(t testing.TB) *ControlPlane {
	t.Helper()
	if s.cp != nil {
		return s.cp
	}
	if s.skipReason != "" {
		t.Skip(s.skipReason)
	}
	t.Fatal("controlplane.Shared.Get called without a control plane: call Shared.Main from TestMain")
	return nil
}
