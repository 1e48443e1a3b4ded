package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testsidecar"
)

var (
	kube   controlplane.Shared
	binDir string
)

// TestMain starts one control plane for the package. Each test has a namespace and a
// driver name (so Leases) of its own and calls t.Parallel(), except those that stop, restart
// or cut off the API server or etcd, or host sidecars in the test process: they run first,
// one at a time, before the parallel ones start (Go runs a package's parallel tests once
// its other tests have ended).
func TestMain(m *testing.M) { os.Exit(e2e.Main(m, "../..", &kube, &binDir)) }

// scenario is a harness scenario for the test sidecar, whose Lease is named after the
// driver and whose work is labelled ConfigMaps.
type scenario struct {
	*e2e.Scenario
	leaseName string
}

func newScenario(t testing.TB, cfg testdriver.Config) *scenario {
	s := e2e.NewScenario(t, kube.Get(t), binDir, cfg)
	return &scenario{Scenario: s, leaseName: "csi-sidecars-test-" + strings.ReplaceAll(s.Driver.DriverName(), ".", "-")}
}

func (s *scenario) startReplica(name string, extra ...string) *e2e.Replica {
	s.T.Helper()
	args := append([]string{"--namespace=" + s.Namespace, "--workers=4"}, extra...)
	return s.Start(name, []string{"csi-test-sidecar", "test"}, args...)
}

func (s *scenario) lease() *coordinationv1.Lease { return s.Lease(s.leaseName) }

func (s *scenario) waitForHolder(want string) { s.WaitForHolder(s.leaseName, want) }

// createWork creates n labelled ConfigMaps: each is one CSI call for the leader.
func (s *scenario) createWork(n int) {
	s.T.Helper()
	for i := range n {
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{
			Name:   fmt.Sprintf("work-%02d", i),
			Labels: map[string]string{testsidecar.WorkLabel: "yes"},
		}}
		if _, err := s.Client.CoreV1().ConfigMaps(s.Namespace).Create(context.Background(), cm, metav1.CreateOptions{}); err != nil {
			s.T.Fatal(err)
		}
	}
}

// results maps each work ConfigMap's volume name to its recorded result ("" if none).
func (s *scenario) results() map[string]string {
	s.T.Helper()
	list, err := s.Client.CoreV1().ConfigMaps(s.Namespace).List(context.Background(), metav1.ListOptions{LabelSelector: testsidecar.WorkLabel})
	if err != nil {
		s.T.Fatal(err)
	}
	out := map[string]string{}
	for _, cm := range list.Items {
		out[testsidecar.VolumePrefix+cm.Name] = cm.Annotations[testsidecar.ResultAnnotation]
	}
	return out
}

// callsOn returns the CreateVolume calls (the test sidecar's work) on a replica's socket.
func callsOn(calls []testdriver.Call, r *e2e.Replica) []testdriver.Call {
	return e2e.CallsOn(calls, r, testdriver.MethodCreateVolume)
}

// leaderBusy starts replica name, waits until it leads, creates n work items and waits
// until n of its calls are in flight.
func (s *scenario) leaderBusy(name string, n int, extra ...string) *e2e.Replica {
	s.T.Helper()
	r := s.startReplica(name, extra...)
	s.waitForHolder(name)
	r.WaitReady(s.T)
	s.createWork(n)
	s.WaitForCalls(fmt.Sprintf("%d calls in flight on %s", n, name), func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, r)) == n })
	return r
}

// waitDraining waits until r reports on /readyz that it drains.
func (s *scenario) waitDraining(r *e2e.Replica) {
	s.T.Helper()
	s.WaitUntil(r.Name+" is draining", func() bool {
		_, body := r.Get("/readyz")
		return strings.Contains(body, "draining")
	})
}
