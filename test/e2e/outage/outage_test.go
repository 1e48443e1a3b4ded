// Package outage measures what a control-plane outage does to two replicas of
// csi-sidecars --controllers=attacher,provisioner,resizer at upstream's Lease timings
// (15 s / 10 s / 5 s) and default QPS, with driver calls of 2 s in flight: kube-apiserver
// killed and restarted, etcd killed and restarted, and kube-apiserver down past the renew
// deadline. It prints figures (make bench) and asserts only what must hold in every run:
// no two calls of one kind on one volume at once, and everything done in the end.
package outage

import (
	"context"
	"flag"
	"fmt"
	"os"
	"slices"
	"sort"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

var (
	kube   controlplane.Shared
	binDir string
)

// TestMain builds the binaries and starts a control plane for the benchmark only; the
// short versions of these runs are tests of package e2e, which make test runs.
func TestMain(m *testing.M) {
	flag.Parse()
	if !e2e.Benchmarks() {
		os.Exit(m.Run())
	}
	os.Exit(e2e.Main(m, "../../..", &kube, &binDir))
}

// upstreamLease is upstream's default Lease timing.
var upstreamLease = []string{"--leader-election-lease-duration=15s", "--leader-election-renew-deadline=10s", "--leader-election-retry-period=5s"}

var threeSidecars = []string{"attacher", "provisioner", "resizer"}

// fault is one control-plane outage: it starts about 2 s after the leader's last renewal.
type fault struct {
	name string
	down func(cp *controlplane.ControlPlane) error
	up   func(cp *controlplane.ControlPlane) error
	// downFor is how long the component stays down before it is started again.
	downFor time.Duration
}

var faults = []fault{
	{"kube-apiserver killed, restarted 5 s later", (*controlplane.ControlPlane).KillAPIServer, startAPIServer, 5 * time.Second},
	{"etcd killed, restarted 5 s later", (*controlplane.ControlPlane).KillEtcd, startEtcd, 5 * time.Second},
	{"kube-apiserver down 25 s, past the renew deadline", (*controlplane.ControlPlane).KillAPIServer, startAPIServer, 25 * time.Second},
}

func startAPIServer(cp *controlplane.ControlPlane) error {
	return cp.StartAPIServer(context.Background())
}
func startEtcd(cp *controlplane.ControlPlane) error { return cp.StartEtcd(context.Background()) }

// figures are one run's.
type figures struct {
	unreachable time.Duration // from the kill to the component's return
	leaderKept  bool          // replica-a still runs and holds every Lease
	exitCode    int           // replica-a's, when it exited
	converged   time.Duration // from the kill until every claim is provisioned, attached and expanded
	// firstPublish is, for each attachment created right after the return, the wait for
	// its first ControllerPublishVolume.
	firstPublish []time.Duration
	overlaps     int
}

func (f figures) String() string {
	sort.Slice(f.firstPublish, func(i, j int) bool { return f.firstPublish[i] < f.firstPublish[j] })
	median, longest := time.Duration(0), time.Duration(0)
	if n := len(f.firstPublish); n > 0 {
		median, longest = f.firstPublish[n/2], f.firstPublish[n-1]
	}
	leader := "kept leading"
	if !f.leaderKept {
		leader = fmt.Sprintf("exited %d, standby took over", f.exitCode)
	}
	return fmt.Sprintf("unreachable %v; leader %s; converged %v after the kill; first publish of attachments created at the return: median %v, max %v; overlaps %d",
		f.unreachable.Round(100*time.Millisecond), leader, f.converged.Round(100*time.Millisecond), median.Round(100*time.Millisecond), longest.Round(100*time.Millisecond), f.overlaps)
}

// BenchmarkControlPlaneOutage prints, for each fault, the figures of one run.
func BenchmarkControlPlaneOutage(b *testing.B) {
	for _, f := range faults {
		b.Run(f.name, func(b *testing.B) {
			for range b.N {
				fmt.Printf("FIGURE outage %q: %v\n", f.name, run(b, f))
			}
		})
	}
}

func run(t testing.TB, f fault) figures {
	latency := 2 * time.Second
	s := e2e.NewScenario(t, kube.Get(t), binDir, testdriver.Config{MethodLatency: map[string]time.Duration{
		testdriver.MethodCreateVolume: latency, testdriver.MethodControllerPublishVolume: latency, testdriver.MethodControllerExpandVolume: latency,
	}})
	ctx := context.Background()
	store := s.SetUpStorage(nil)
	command := []string{"csi-sidecars", "--controllers=attacher,provisioner,resizer"}
	a := s.Start("replica-a", command, upstreamLease...)
	a.WaitReady(t)
	leases := map[string]string{}
	for _, sidecar := range threeSidecars {
		leases[sidecar] = e2e.LeaseName(sidecar, store.Driver)
		s.WaitForHolder(leases[sidecar], "replica-a")
	}
	sb := s.Start("replica-b", command, upstreamLease...)
	sb.WaitReady(t)

	// Work in flight: six claims provisioned and bound; three attached, three expanded,
	// their calls running when the fault comes.
	var claims []string
	for i := range 6 {
		claims = append(claims, fmt.Sprintf("claim-%d", i))
		if err := store.CreateClaim(ctx, claims[i]); err != nil {
			t.Fatal(err)
		}
	}
	s.WaitUntil("six volumes provisioned", func() bool { pvs, err := store.Provisioned(ctx); return err == nil && len(pvs) == 6 })
	if _, err := store.BindAll(ctx); err != nil {
		t.Fatal(err)
	}
	pvs, err := store.Provisioned(ctx)
	if err != nil {
		t.Fatal(err)
	}
	byClaim := map[string]string{}
	for _, pv := range pvs {
		byClaim[pv.Spec.ClaimRef.Name] = pv.Name
	}
	for _, c := range claims[:3] {
		if err := store.CreateAttachment(ctx, byClaim[c]); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range claims[3:] {
		if err := store.Expand(ctx, c, "2Gi"); err != nil {
			t.Fatal(err)
		}
	}

	// The fault, about 2 s after the attacher Lease's last renewal.
	renewed := nextRenewal(t, s, leases["attacher"])
	time.Sleep(time.Until(renewed.Add(2 * time.Second)))
	if err := f.down(s.CP); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	time.Sleep(f.downFor)
	if err := f.up(s.CP); err != nil {
		t.Fatal(err)
	}
	returned := time.Now()
	for _, c := range claims[3:] {
		if err := store.CreateAttachment(ctx, byClaim[c]); err != nil {
			t.Fatal(err)
		}
	}
	created := time.Now()

	s.WaitUntil("every volume attached and expanded", func() bool {
		attached, err := store.Attached(ctx)
		if err != nil || attached != 6 {
			return false
		}
		expanded, err := store.Expanded(ctx, "2Gi")
		return err == nil && expanded == 3
	})
	out := figures{unreachable: returned.Sub(killed), converged: time.Since(killed)}
	out.leaderKept = a.Running()
	for _, lease := range leases {
		if e2e.Holder(s.Lease(lease)) != "replica-a" {
			out.leaderKept = false
		}
	}
	if !a.Running() {
		out.exitCode = a.ExitCode
	}
	handles := map[string]bool{}
	for _, pv := range pvs {
		if slices.Contains(claims[3:], pv.Spec.ClaimRef.Name) {
			handles[pv.Spec.CSI.VolumeHandle] = true
		}
	}
	first := map[string]time.Time{}
	for _, c := range s.Driver.Journal() {
		if c.Method == testdriver.MethodControllerPublishVolume && handles[c.VolumeID] && c.Start.After(created) {
			if at, ok := first[c.VolumeID]; !ok || c.Start.Before(at) {
				first[c.VolumeID] = c.Start
			}
		}
	}
	for _, at := range first {
		out.firstPublish = append(out.firstPublish, at.Sub(created))
	}
	for _, o := range s.Driver.Overlaps() {
		if o.First.Method == o.Second.Method {
			out.overlaps++
			t.Errorf("two %s calls on volume %s at once (sockets %s and %s)", o.First.Method, o.Volume, o.First.Socket, o.Second.Socket)
		}
	}
	return out
}

// nextRenewal waits for the next change of the Lease's renewTime and returns it.
func nextRenewal(t testing.TB, s *e2e.Scenario, lease string) time.Time {
	t.Helper()
	before := s.Lease(lease).Spec.RenewTime
	var at time.Time
	s.WaitUntil("the next renewal of "+lease, func() bool {
		l, err := s.Client.CoordinationV1().Leases(s.Namespace).Get(context.Background(), lease, metav1.GetOptions{})
		if err != nil || l.Spec.RenewTime == nil || (before != nil && l.Spec.RenewTime.Equal(before)) {
			return false
		}
		at = l.Spec.RenewTime.Time
		return true
	})
	return at
}
