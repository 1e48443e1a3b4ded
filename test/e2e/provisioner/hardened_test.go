package provisioner

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// Clusters this project did not choose (promise P17): an API server that rate-limits or
// expires events, a cluster of 150 nodes. Where upstream provisions, this provisions, and
// the record (P13) protects wherever it can be kept; what it cannot protect is reported.

// eventRateLimit is the EventRateLimit admission of the CIS benchmark's kind: one event a
// second per namespace, bursts of %d.
const eventRateLimit = `apiVersion: apiserver.config.k8s.io/v1
kind: AdmissionConfiguration
plugins:
- name: EventRateLimit
  configuration:
    apiVersion: eventratelimit.admission.k8s.io/v1alpha1
    kind: Configuration
    limits:
    - type: Namespace
      qps: 1
      burst: %d
`

// hardenedScenario is a scenario on a control plane of its own, started with the
// kube-apiserver flags args.
func hardenedScenario(t testing.TB, cfg testdriver.Config, args ...string) *scenario {
	t.Helper()
	return scenarioOn(t, hardenedControlPlane(t, args...), cfg)
}

// hardenedControlPlane is a control plane of the test's own, its kube-apiserver started with
// args; Stop ends it with the test.
func hardenedControlPlane(t testing.TB, args ...string) *controlplane.ControlPlane {
	t.Helper()
	kube.Get(t) // skips where no control plane can run
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cp, err := controlplane.Start(ctx, controlplane.Options{APIServerArgs: args})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cp.Stop() })
	return cp
}

// scenarioOn is a scenario on cp, a control plane of the test's alone: nothing to clean up
// in it.
func scenarioOn(t testing.TB, cp *controlplane.ControlPlane, cfg testdriver.Config) *scenario {
	t.Helper()
	s := e2e.NewScenario(t, cp, binDir, cfg)
	return &scenario{Scenario: s, driver: s.Driver.DriverName(), leaseName: e2e.LeaseName("provisioner", s.Driver.DriverName())}
}

// eventRateLimitArgs are kube-apiserver's flags for the eventRateLimit admission with
// bursts of burst, its configuration written into dir.
func eventRateLimitArgs(t testing.TB, dir string, burst int) []string {
	t.Helper()
	admission := filepath.Join(dir, "admission.yaml")
	if err := os.WriteFile(admission, []byte(fmt.Sprintf(eventRateLimit, burst)), 0o600); err != nil {
		t.Fatal(err)
	}
	return []string{"--enable-admission-plugins=EventRateLimit", "--admission-control-config-file=" + admission}
}

// metric is the total of a metric's series on a replica's /metrics (0 when absent).
func metric(t testing.TB, r *e2e.Replica, name string) float64 {
	t.Helper()
	code, body := r.Get("/metrics")
	if code != 200 {
		return 0
	}
	total, _, err := e2e.MetricTotal(body, name, nil)
	if err != nil {
		t.Fatal(err)
	}
	return total
}

// recordedClaims are the UIDs of the claims some Provisioning event of the namespace
// carries a record of.
func (s *scenario) recordedClaims() map[types.UID]bool {
	s.T.Helper()
	list, err := s.Client.CoreV1().Events(s.Namespace).List(s.ctx(), metav1.ListOptions{LabelSelector: recordLabel})
	if err != nil {
		s.T.Fatal(err)
	}
	out := map[types.UID]bool{}
	for _, ev := range list.Items {
		if _, ok := ev.Annotations[recordAnnotation]; ok {
			out[ev.InvolvedObject.UID] = true
		}
		for _, c := range alsoCarried(&ev) {
			out[c] = true
		}
	}
	return out
}

// recordAlso is the annotation of a Provisioning event that carries the records of further
// claims (a JSON list), as the provisioner spells it.
const recordAlso = "provisioner.csi-sidecars.io/provisioning-also"

// alsoCarried are the UIDs of the further claims whose records ev carries.
func alsoCarried(ev *v1.Event) []types.UID {
	var also []struct {
		Claim v1.ObjectReference `json:"claim"`
	}
	if err := json.Unmarshal([]byte(ev.Annotations[recordAlso]), &also); err != nil {
		return nil
	}
	var out []types.UID
	for _, c := range also {
		out = append(out, c.Claim.UID)
	}
	return out
}

// A StatefulSet's scale-up of 20 claims, each request carrying 150 nodes' topology,
// against an API server with EventRateLimit admission (bursts of one, so that the burst
// certainly meets the limit). No event is refused as too large;
// the records the rate limit refuses are reported, the provisioning goes on without them,
// and they are retried until events keep them: while the driver still works on the calls
// (held here), every claim's record is kept. Then every claim is provisioned.
func TestABurstOfClaimsOfA150NodeClusterIsProvisionedUnderEventRateLimit(t *testing.T) {
	s := hardenedScenario(t, testdriver.Config{Topology: true}, eventRateLimitArgs(t, t.TempDir(), 1)...)
	const nodes, claims = 150, 20
	for i := range nodes {
		s.createNode(fmt.Sprintf("n%03d", i))
	}
	fast := s.createClass("fast", nil)
	r := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")

	release := s.Driver.Hold(testdriver.MethodCreateVolume)
	t.Cleanup(release)
	start := time.Now()
	var wg sync.WaitGroup
	for i := range claims {
		wg.Go(func() { s.createClaim(fmt.Sprintf("data-%02d", i), fast.Name, "") })
	}
	wg.Wait()
	s.WaitForCalls("every claim's CreateVolume in the driver", func([]testdriver.Call) bool {
		return metric(t, r, "csi_sidecars_provisioner_records_not_kept_total") > 0 || len(s.recordedClaims()) == claims
	})
	s.WaitUntil("every claim's record kept in an event", func() bool { return len(s.recordedClaims()) == claims })
	kept := time.Since(start)
	release()
	s.waitForPVs(claims)
	s.checkEveryVolumeHasExactlyOnePV()
	notKept := metric(t, r, "csi_sidecars_provisioner_records_not_kept_total")
	t.Logf("FIGURE %d claims of a %d-node cluster under EventRateLimit (namespace, qps 1, burst 1): %.0f records refused at first and reported, all %d kept in events %v after the claims, all provisioned",
		claims, nodes, notKept, claims, kept.Round(100*time.Millisecond))
	if notKept == 0 {
		t.Errorf("no record reported as refused: the rate limit refused none, and the test shows nothing")
	}
}

// An API server whose --event-ttl is shorter than a CreateVolume: the record's events
// expire while the call runs, and the leader writes them again; then it is SIGKILLed and
// the claims deleted. The standby, which watched the records, takes over and undoes every
// volume: none leaks.
func TestRecordsThatExpireWhileCreateVolumeRunsAreWrittenAgainAndNothingLeaks(t *testing.T) {
	s := hardenedScenario(t, testdriver.Config{}, "--event-ttl=6s", "--lease-reuse-duration-seconds=1")
	fast := s.createClass("fast", nil)
	a := s.startReplica("replica-a", e2e.ChaosLease...)
	s.WaitForHolder(s.leaseName, "replica-a")
	b := s.startReplica("replica-b", e2e.ChaosLease...)
	b.WaitReady(t)

	release := s.Driver.Hold(testdriver.MethodCreateVolume)
	t.Cleanup(release)
	const claims = 4
	var made []*v1.PersistentVolumeClaim
	for i := range claims {
		made = append(made, s.createClaim(fmt.Sprintf("data-%d", i), fast.Name, ""))
	}
	s.WaitUntil("every claim's record in an event", func() bool { return len(s.recordedClaims()) == claims })
	// The API server removes the events after 6 s; the leader notices and writes them again.
	s.WaitUntil("every record written again after its event expired", func() bool {
		return metric(t, a, "csi_sidecars_provisioner_records_rewritten_total") >= claims
	})
	s.WaitUntil("every claim's record in an event again", func() bool { return len(s.recordedClaims()) == claims })

	a.Signal(t, syscall.SIGKILL)
	for _, c := range made {
		if err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Delete(s.ctx(), c.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The killed leader's calls end in the driver: each makes its volume.
	release()
	s.WaitUntil("the dead leader's volumes made", func() bool { return len(s.Driver.Volumes()) == claims })
	s.WaitForHolder(s.leaseName, "replica-b")
	s.WaitUntil("every volume undone by the new leader", func() bool { return len(s.Driver.Volumes()) == 0 })
	if pvs := s.pvs(); len(pvs) != 0 {
		t.Errorf("%d PersistentVolumes of deleted claims", len(pvs))
	}
	t.Logf("FIGURE --event-ttl=6s, leader SIGKILLed mid-CreateVolume after its records expired: %d of %d volumes undone, 0 leaked; %.0f records written again by the new leader",
		claims, claims, metric(t, b, "csi_sidecars_provisioner_records_rewritten_total"))
}

// An API server that refuses every event the provisioner writes (here RBAC without
// "create" on events; an admission webhook or policy does the same): every record is
// refused, and every claim is provisioned all the same, as upstream's would be (P17: never
// a stall), each refusal reported. (A count/events ResourceQuota refuses nothing: the
// API server's quota admission does not count events.)
func TestClaimsAreProvisionedWhereTheAPIServerRefusesEveryEvent(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	rules := upstreamClusterRules(snapshotVerbsV62)
	for i, r := range rules {
		if slices.Contains(r.Resources, "events") {
			rules[i].Verbs = []string{"list", "watch"}
		}
	}
	kubeconfig := s.KubeconfigWithRules("csi-provisioner", e2e.Rules{Cluster: rules, Namespace: upstreamNamespaceRules})
	fast := s.createClass("fast", nil)
	r := s.startReplica("replica-a", "--kubeconfig="+kubeconfig)
	s.WaitForHolder(s.leaseName, "replica-a")
	const claims = 5
	for i := range claims {
		s.createClaim(fmt.Sprintf("data-%d", i), fast.Name, "")
	}
	s.waitForPVs(claims)
	s.checkEveryVolumeHasExactlyOnePV()
	if n := metric(t, r, "csi_sidecars_provisioner_records_not_kept_total"); n < claims {
		t.Errorf("%.0f records reported not kept, want all %d", n, claims)
	}
}
