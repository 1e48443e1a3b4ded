package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testsidecar"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// inProcess is one process (lifecycle.RunWithSignals in the test) hosting two test
// sidecars, "one" and "two", each with its own namespace of work and its own Lease.
type inProcess struct {
	*e2e.Scenario
	namespaces map[string]string // sidecar -> namespace of its work
	leases     map[string]string // sidecar -> Lease name
	signals    chan os.Signal
	exited     chan int
	// before are the test process's goroutines just before the run started.
	before goleak.Option
}

// startInProcess starts the process and waits until it leads both Leases.
func startInProcess(t *testing.T, latency time.Duration) *inProcess {
	s := e2e.NewScenario(t, kube.Get(t), binDir, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: latency}})
	ctx := context.Background()
	srv, err := s.Driver.Serve(filepath.Join(s.Dir, "shared.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	p := &inProcess{Scenario: s, namespaces: map[string]string{"one": s.Namespace + "-one", "two": s.Namespace + "-two"},
		leases: map[string]string{}, signals: make(chan os.Signal, 2), exited: make(chan int, 1)}
	var sidecars []lifecycle.Hosted
	for name, ns := range p.namespaces {
		if _, err := s.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		sidecars = append(sidecars, testsidecar.NewInProcess(name, ns))
	}

	opts := lifecycle.NewOptions()
	opts.CSIAddress = srv.Endpoint()
	opts.Kubeconfig = s.CP.KubeconfigPath()
	opts.LeaderElection = true
	opts.LeaderElectionNamespace = s.Namespace
	opts.LeaderElectionIdentity = "process-1"
	opts.LeaseDuration, opts.RenewDeadline, opts.RetryPeriod = 30*time.Second, 20*time.Second, 10*time.Second
	if err := opts.Validate(); err != nil {
		t.Fatal(err)
	}
	p.before = goleak.IgnoreCurrent()
	go func() {
		p.exited <- lifecycle.RunWithSignals(ctx, opts, p.signals, func(code int) { t.Errorf("exited at once with %d", code) }, sidecars...)
	}()
	for name := range p.namespaces {
		p.leases[name] = lifecycle.SanitizeName("csi-sidecars-" + name + "-" + s.Driver.DriverName())
		s.WaitForHolder(p.leases[name], "process-1")
	}
	return p
}

// createWork creates n work ConfigMaps for each sidecar, named after it, so the driver's
// journal tells the sidecars' calls apart (vol-one-work-0, vol-two-work-0).
func (p *inProcess) createWork(n int) {
	for name, ns := range p.namespaces {
		for i := range n {
			cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-work-%d", name, i), Labels: map[string]string{testsidecar.WorkLabel: "yes"}}}
			if _, err := p.Client.CoreV1().ConfigMaps(ns).Create(context.Background(), cm, metav1.CreateOptions{}); err != nil {
				p.T.Fatal(err)
			}
		}
	}
}

// wait waits for the process to end and returns its exit code.
func (p *inProcess) wait() int {
	select {
	case code := <-p.exited:
		return code
	case <-time.After(30 * time.Second):
		p.T.Fatal("the process did not finish draining")
		return -1
	}
}

// results are the recorded results of a sidecar's work ConfigMaps.
func (p *inProcess) results(name string) map[string]string {
	list, err := p.Client.CoreV1().ConfigMaps(p.namespaces[name]).List(context.Background(), metav1.ListOptions{LabelSelector: testsidecar.WorkLabel})
	if err != nil {
		p.T.Fatal(err)
	}
	out := map[string]string{}
	for _, cm := range list.Items {
		out[cm.Name] = cm.Annotations[testsidecar.ResultAnnotation]
	}
	return out
}

// One process can host several sidecars: each leads its own Lease, and one signal drains
// them all and releases every Lease.
func TestOneProcessHostsTwoSidecarsEachWithItsOwnLease(t *testing.T) {
	p := startInProcess(t, 2*time.Second)
	p.createWork(2)
	p.WaitForCalls("4 calls in flight, 2 per sidecar", func(c []testdriver.Call) bool { return e2e.Running(c) == 4 })

	p.signals <- syscall.SIGTERM
	if code := p.wait(); code != lifecycle.ExitOK {
		t.Errorf("exit code %d, want 0", code)
	}
	for _, c := range p.Driver.Journal() {
		if c.Method == testdriver.MethodCreateVolume && (c.Code != "OK" || !c.CallerGone.IsZero()) {
			t.Errorf("call for %s: code %s, caller gone %v; want OK, not cancelled", c.VolumeName, c.Code, !c.CallerGone.IsZero())
		}
	}
	for name := range p.namespaces {
		if h := e2e.Holder(p.Lease(p.leases[name])); h != "" {
			t.Errorf("Lease of %s held by %q after the drain, want released", name, h)
		}
		for cm, r := range p.results(name) {
			if r != "ok" {
				t.Errorf("%s/%s: result %q, want ok", name, cm, r)
			}
		}
	}
}

// When one of several sidecars in a process is fenced, the others drain and release their
// Leases and the process exits non-zero, so the kubelet restarts it: no half-dead process.
func TestOneFencedSidecarEndsTheProcessAfterTheOthersDrain(t *testing.T) {
	p := startInProcess(t, 0)
	// The driver holds every call until the test releases it: the fenced sidecar's calls
	// still run when the fence comes, and the other sidecar's keep the process draining.
	release := p.Driver.Hold(testdriver.MethodCreateVolume)
	t.Cleanup(release)
	p.createWork(2)
	p.WaitForCalls("4 calls in flight, 2 per sidecar", func(c []testdriver.Call) bool { return e2e.Running(c) == 4 })

	l := p.Lease(p.leases["one"])
	l.Spec.HolderIdentity = ptr.To("intruder")
	l.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
	if _, err := p.Client.CoordinationV1().Leases(p.Namespace).Update(context.Background(), l, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// P6: the fence cancels the fenced sidecar's calls at once, while the process still
	// runs (the other sidecar drains its held calls), not when the process ends.
	p.WaitForCalls("the fenced sidecar's calls cancelled, the other's still running", func(c []testdriver.Call) bool {
		cancelled, running := 0, 0
		for _, call := range c {
			switch {
			case call.Method != testdriver.MethodCreateVolume:
			case strings.HasPrefix(call.VolumeName, testsidecar.VolumePrefix+"one-") && !call.CallerGone.IsZero():
				cancelled++
			case strings.HasPrefix(call.VolumeName, testsidecar.VolumePrefix+"two-") && !call.Done() && call.CallerGone.IsZero():
				running++
			}
		}
		return cancelled == 2 && running == 2
	})
	release()
	if code := p.wait(); code != lifecycle.ExitError {
		t.Errorf("exit code %d, want %d", code, lifecycle.ExitError)
	}
	if h := e2e.Holder(p.Lease(p.leases["one"])); h != "intruder" {
		t.Errorf("fenced sidecar's Lease held by %q, want intruder", h)
	}
	if h := e2e.Holder(p.Lease(p.leases["two"])); h != "" {
		t.Errorf("the other sidecar's Lease held by %q, want released", h)
	}
	for cm, r := range p.results("two") {
		if r != "ok" {
			t.Errorf("two/%s: result %q, want ok (drained)", cm, r)
		}
	}
	for _, c := range p.Driver.Journal() {
		fenced := strings.HasPrefix(c.VolumeName, testsidecar.VolumePrefix+"one-")
		switch {
		case c.Method != testdriver.MethodCreateVolume:
		case fenced && c.CallerGone.IsZero():
			t.Errorf("the fenced sidecar's call for %s was not cancelled", c.VolumeName)
		case !fenced && (c.Code != "OK" || !c.CallerGone.IsZero()):
			t.Errorf("the other sidecar's call for %s: code %s, caller gone %v; want OK, not cancelled", c.VolumeName, c.Code, !c.CallerGone.IsZero())
		}
	}
}

// A run embedded in a longer-lived process, here the test, leaves none of its goroutines
// behind once RunWithSignals has returned, though the context it was given lives on: the
// Lease watches, the event broadcasters and the API budgets end with the run.
func TestInProcessRunLeavesNoGoroutineBehind(t *testing.T) {
	p := startInProcess(t, 0)
	p.createWork(1)
	for name := range p.namespaces {
		p.WaitUntil("the work of "+name+" recorded", func() bool { return p.results(name)[name+"-work-0"] == "ok" })
	}
	p.signals <- syscall.SIGTERM
	if code := p.wait(); code != lifecycle.ExitOK {
		t.Fatalf("exit code %d, want 0", code)
	}
	goleak.VerifyNone(t, p.before)
}
