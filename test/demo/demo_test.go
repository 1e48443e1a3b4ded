package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cluster"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/kubelet"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/snapshotcontroller"
)

// `make demo DEMO_FLAGS="-short -combined"`: every handover is clean and the summaries are
// printed, the single-sidecar one and the combined one, whose one SIGTERM hands each of the
// four Leases to the combined standby; the claim shows its volume's health as the driver
// changes it; on the kubelet's node the driver is registered, the probes answer, and a
// maxSurge rollout of the node process never takes the driver out of CSINode.
func TestDemoShort(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the demo starts a control plane, the control loop and eight sidecar processes")
	}
	if _, err := cluster.Assets(); err != nil {
		t.Skipf("no real control loop: %v", err)
	}
	if _, err := snapshotcontroller.Assets(); err != nil {
		t.Skipf("no snapshot-controller: %v", err)
	}
	if _, err := kubelet.Assets(); err != nil {
		t.Skipf("no kubelet: %v", err)
	}
	bin, err := e2e.Binaries("../..")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(bin)
	var out bytes.Buffer
	rep, err := run(context.Background(), options{short: true, combined: true, bin: filepath.Join(bin, "csi-sidecars"), logDir: t.TempDir()}, &out)
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Summary", "provisioner-a -> provisioner-b", "attacher-a -> attacher-b", "resizer-a -> resizer-b", "snapshotter-a -> snapshotter-b", "Summary, combined", "Node rollouts"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}

	// Each single-sidecar handover caught calls in flight (run checks the rest: exit 0, no
	// overlaps, all work done).
	for _, h := range rep.single {
		if h.inFlight == 0 || h.leader != h.sidecar+"-a" || h.standby != h.sidecar+"-b" {
			t.Errorf("%s: %s -> %s with %d calls in flight; want %[1]s-a -> %[1]s-b with calls in flight", h.sidecar, h.leader, h.standby, h.inFlight)
		}
	}

	// What the combined summary claims, from what run observed: a row per sidecar, each
	// Lease now held by the standby, a clean exit, no overlaps and all work done.
	sidecars := map[string]bool{"provisioner": false, "attacher": false, "resizer": false, "snapshotter": false}
	for _, h := range rep.combined {
		sidecars[h.sidecar] = true
		if h.leader != "combined-a" || h.standby != "combined-b" {
			t.Errorf("%s: Lease went %s -> %s; want combined-a -> combined-b", h.sidecar, h.leader, h.standby)
		}
		if h.inFlight == 0 {
			t.Errorf("%s: no call in flight at the SIGTERM; the handover proves nothing", h.sidecar)
		}
		if h.exitCode != 0 || h.overlaps != 0 || h.done != h.all {
			t.Errorf("%s: exit %d, %d overlaps, %d/%d done; want exit 0, no overlaps, all done", h.sidecar, h.exitCode, h.overlaps, h.done, h.all)
		}
	}
	checkHealth(t, rep.health)
	checkNode(t, rep.node)
	for sidecar, seen := range sidecars {
		if !seen {
			t.Errorf("the combined run reports no handover of the %s", sidecar)
		}
	}
	if n := len(rep.combined); n != len(sidecars) {
		t.Errorf("the combined run reports %d handovers; want %d", n, len(sidecars))
	}
	for _, name := range []string{"combined-a", "combined-b"} {
		if code := rep.combinedProbes[name]; code != 200 {
			t.Errorf("%s's livenessprobe answered %d; want 200", name, code)
		}
	}
	if !strings.Contains(out.String(), "combined-b (4 sidecars and the livenessprobe, one process)") {
		t.Errorf("output lacks the combined standby's peak RSS beside the single-sidecar standbys'")
	}
}

// checkHealth: the claim showed the driver's condition in status.healthStatus (the demo's
// API server keeps it), then no condition once the driver had none.
func checkHealth(t *testing.T, h volumeHealth) {
	t.Helper()
	want := "DataLoss/" + unhealthy.Reason
	if h.condition != want || h.where != "status.healthStatus" {
		t.Errorf("claim %s showed %q in %s; want %q in status.healthStatus", h.claim, h.condition, h.where, want)
	}
	if h.shownUnhealthy <= 0 || h.shownHealthy <= 0 {
		t.Errorf("claim %s: unhealthy shown after %v, healthy after %v; want both seen", h.claim, h.shownUnhealthy, h.shownHealthy)
	}
}

// checkNode: CSINode listed the driver with the node's ID, the node process's probe
// answered 200, the maxSurge rollout kept the driver in CSINode with no new registration,
// the maxUnavailable one brought it back, and every old process exited 0.
func checkNode(t *testing.T, n nodeReport) {
	t.Helper()
	if n.nodeID != kubeletNode || n.registered <= 0 {
		t.Errorf("CSINode %s: driver with node ID %q after %v; want node ID %s", n.node, n.nodeID, n.registered, kubeletNode)
	}
	if n.probeCode != 200 {
		t.Errorf("the node process's livenessprobe answered %d; want 200", n.probeCode)
	}
	if len(n.rollouts) != 2 {
		t.Fatalf("%d node rollouts; want maxSurge and maxUnavailable", len(n.rollouts))
	}
	for _, ro := range n.rollouts {
		if ro.exitCode != 0 || !ro.present {
			t.Errorf("%s: %s exited %d, driver in CSINode at the end: %v; want exit 0 and the driver there", ro.strategy, ro.old, ro.exitCode, ro.present)
		}
	}
	if s := n.rollouts[0]; s.strategy != "maxSurge" || len(s.absences) != 0 || s.registrations != 0 {
		t.Errorf("%s: driver absent %d time(s), %v, registered %d time(s) again; want maxSurge with no absence and no registration",
			s.strategy, len(s.absences), s.absent, s.registrations)
	}
	if u := n.rollouts[1]; u.strategy != "maxUnavailable" || u.registrations == 0 {
		t.Errorf("%s: the kubelet registered the driver %d time(s); want maxUnavailable with a new registration", u.strategy, u.registrations)
	}
}

// BenchmarkFailover runs the demo (short mode) and reports, per sidecar, the leader's drain,
// the standby's first call after the leader's exit and its peak memory.
func BenchmarkFailover(b *testing.B) {
	if _, err := cluster.Assets(); err != nil {
		b.Skipf("no real control loop: %v", err)
	}
	if _, err := snapshotcontroller.Assets(); err != nil {
		b.Skipf("no snapshot-controller: %v", err)
	}
	if _, err := kubelet.Assets(); err != nil {
		b.Skipf("no kubelet: %v", err)
	}
	bin, err := e2e.Binaries("../..")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(bin)
	for range b.N {
		var out bytes.Buffer
		rep, err := run(context.Background(), options{short: true, bin: filepath.Join(bin, "csi-sidecars"), logDir: b.TempDir()}, &out)
		if err != nil {
			b.Fatalf("%v\n%s", err, out.String())
		}
		for _, h := range rep.single {
			b.ReportMetric(h.drain.Seconds(), h.sidecar+"-drain-s")
			b.ReportMetric(h.firstCallAfterExit.Seconds(), h.sidecar+"-takeover-s")
			b.ReportMetric(float64(h.overlaps), h.sidecar+"-overlaps")
			b.ReportMetric(float64(h.standbyPeakRSS)/(1<<20), h.sidecar+"-peak-MiB")
		}
	}
}
