package e2e

import (
	"syscall"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// A role that grants the sidecar's work but neither events nor list and watch on Leases
// (as older upstream roles do) costs nothing but speed: the replica polls the Lease, drops
// events after one warning, and never logs a refused request.
func TestRoleWithoutEventsOrLeaseWatchDegradesWithoutRefusals(t *testing.T) {
	t.Parallel()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: time.Second}})
	rules := e2e.Rules{
		Cluster:   []rbacv1.PolicyRule{e2e.Rule("", []string{"configmaps"}, "get", "list", "watch", "patch")},
		Namespace: []rbacv1.PolicyRule{e2e.Rule("coordination.k8s.io", []string{"leases"}, "get", "create", "update")},
	}
	timing := []string{"--leader-election-lease-duration=6s", "--leader-election-renew-deadline=4s", "--leader-election-retry-period=1s"}
	a := s.startReplica("replica-a", append(timing, "--kubeconfig="+s.KubeconfigWithRules("sidecar-a", rules))...)
	s.waitForHolder("replica-a")
	b := s.startReplica("replica-b", append(timing, "--kubeconfig="+s.KubeconfigWithRules("sidecar-b", rules))...)
	a.WaitReady(t)
	b.WaitReady(t)
	s.createWork(6)
	s.WaitForCalls("replica-a at work", func(c []testdriver.Call) bool { return e2e.Running(callsOn(c, a)) > 0 })

	a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("replica-a exit code %d, want 0", code)
	}
	s.WaitUntil("all 6 results recorded", func() bool { return countResults(s.results(), "ok") == 6 })
	if n := len(callsOn(s.Driver.Journal(), b)); n == 0 {
		t.Errorf("replica-b never took over")
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("driver saw %d overlapping operations", len(o))
	}
	e2e.NoForbidden(t, a, b)
}
