package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testdriver"
	"github.com/csi-sidecars/csi-sidecars/internal/testsidecar"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// One process can host several sidecars: each leads its own Lease, and one signal drains
// them all and releases every Lease. (The multi-sidecar subcommand comes later; this proves
// nothing in the core stands in its way.)
func TestOneProcessHostsTwoSidecarsEachWithItsOwnLease(t *testing.T) {
	s := e2e.NewScenario(t, kube.Get(t), binDir, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: 2 * time.Second}})
	ctx := context.Background()
	srv, err := s.Driver.Serve(filepath.Join(s.Dir, "shared.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	namespaces := map[string]string{"one": s.Namespace + "-one", "two": s.Namespace + "-two"}
	var sidecars []lifecycle.Sidecar
	for name, ns := range namespaces {
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
	signals := make(chan os.Signal, 2)
	exited := make(chan int, 1)
	go func() {
		exited <- lifecycle.RunWithSignals(ctx, opts, signals, func(code int) { t.Errorf("exited at once with %d", code) }, sidecars...)
	}()

	leases := map[string]string{}
	for name := range namespaces {
		leases[name] = lifecycle.SanitizeName("csi-sidecars-" + name + "-" + s.Driver.DriverName())
		s.WaitForHolder(leases[name], "process-1")
	}
	for _, ns := range namespaces {
		for i := range 2 {
			cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("work-%d", i), Labels: map[string]string{testsidecar.WorkLabel: "yes"}}}
			if _, err := s.Client.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	s.WaitForCalls("4 calls in flight, 2 per sidecar", func(c []testdriver.Call) bool { return e2e.Running(c) == 4 })

	signals <- syscall.SIGTERM
	select {
	case code := <-exited:
		if code != lifecycle.ExitOK {
			t.Errorf("exit code %d, want 0", code)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the process did not finish draining")
	}
	for _, c := range s.Driver.Journal() {
		if c.Method == testdriver.MethodCreateVolume && (c.Code != "OK" || !c.CallerGone.IsZero()) {
			t.Errorf("call for %s: code %s, caller gone %v; want OK, not cancelled", c.VolumeName, c.Code, !c.CallerGone.IsZero())
		}
	}
	for name, ns := range namespaces {
		if h := e2e.Holder(s.Lease(leases[name])); h != "" {
			t.Errorf("Lease of %s held by %q after the drain, want released", name, h)
		}
		list, err := s.Client.CoreV1().ConfigMaps(ns).List(ctx, metav1.ListOptions{LabelSelector: testsidecar.WorkLabel})
		if err != nil {
			t.Fatal(err)
		}
		for _, cm := range list.Items {
			if r := cm.Annotations[testsidecar.ResultAnnotation]; r != "ok" {
				t.Errorf("%s/%s: result %q, want ok", ns, cm.Name, r)
			}
		}
	}
}
