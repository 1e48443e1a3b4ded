package provisioner

import (
	"fmt"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstream"
)

// BenchmarkProvisioningOnHardenedAPIServers (make bench) provisions a StatefulSet's
// scale-up, 40 claims created at once whose requests carry 150 nodes' topology, with this
// provisioner and with upstream's (external-provisioner, built from the Go module proxy),
// each alone with upstream's default flags, on API servers of two kinds: defaults, and the
// EventRateLimit admission (namespace, qps 1, burst 5). It prints the time until every
// claim has its PersistentVolume (at most 120 s) and, for ours, what the record kept.
// Figures are printed, never asserted.
func BenchmarkProvisioningOnHardenedAPIServers(b *testing.B) {
	theirs := upstream.Releases()[1]
	if theirs.Sidecar != "provisioner" {
		b.Fatalf("upstream release %v is not the provisioner's", theirs)
	}
	path, err := theirs.Build()
	if err != nil {
		b.Logf("FIGURE upstream %v not built, measuring ours alone: %v", theirs, err)
	}
	for _, setting := range []struct {
		name string
		args func() []string
	}{
		{"defaults", func() []string { return nil }},
		{"EventRateLimit", func() []string { return eventRateLimitArgs(b, b.TempDir(), 5) }},
	} {
		cp := hardenedControlPlane(b, setting.args()...)
		for _, impl := range []string{"ours", "upstream"} {
			if impl == "upstream" && err != nil {
				continue
			}
			for range b.N {
				took, bound, kept, notKept := scaleUp(b, cp, impl, path)
				if impl == "ours" {
					b.Logf("FIGURE %s, %s: %d of 40 claims bound in %v; %d records kept in events, %.0f refused and reported", setting.name, impl, bound, took.Round(100*time.Millisecond), kept, notKept)
				} else {
					b.Logf("FIGURE %s, %s %s: %d of 40 claims bound in %v", setting.name, impl, theirs.Tag, bound, took.Round(100*time.Millisecond))
				}
			}
		}
	}
}

// scaleUp runs one scale-up on cp with impl ("ours", or "upstream" at path): the time until
// every claim had its PersistentVolume, or 120 s; how many had one; for ours, the records
// kept in events and those reported not kept.
func scaleUp(b *testing.B, cp *controlplane.ControlPlane, impl, path string) (time.Duration, int, int, float64) {
	const nodes, claims, limit = 150, 40, 120 * time.Second
	s := scenarioOn(b, cp, testdriver.Config{Topology: true})
	for i := range nodes {
		s.createNode(fmt.Sprintf("n%03d", i))
	}
	fast := s.createClass("fast", nil)
	var r *e2e.Replica
	if impl == "ours" {
		r = s.Start(impl, []string{"csi-sidecars", "provisioner"})
	} else {
		r = s.StartUpstream(impl, path)
	}
	s.WaitUntil("a leader", func() bool {
		l, err := s.Client.CoordinationV1().Leases(s.Namespace).Get(s.ctx(), s.leaseName, metav1.GetOptions{})
		return err == nil && l.Spec.HolderIdentity != nil && *l.Spec.HolderIdentity != ""
	})
	start := time.Now()
	var wg sync.WaitGroup
	for i := range claims {
		wg.Go(func() { s.createClaim(fmt.Sprintf("data-%02d", i), fast.Name, "") })
	}
	wg.Wait()
	bound := 0
	for time.Since(start) < limit {
		if bound = len(s.pvs()); bound >= claims {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	took := time.Since(start)
	if impl != "ours" {
		return took, bound, 0, 0
	}
	return took, bound, len(s.recordedClaims()), metric(b, r, "csi_sidecars_provisioner_records_not_kept_total")
}
