package scale

import (
	"testing"
	"time"
)

const (
	// shortVolumes and shortWindow keep the test well under a minute.
	shortVolumes = 300
	shortWindow  = 5 * time.Second
	// benchVolumes and benchWindow are the benchmark's: the 10,000 objects, and
	// the first 10 s of the new leader.
	benchVolumes = 10000
	benchWindow  = 10 * time.Second
)

// With a few hundred settled volumes, each sidecar's SIGTERMed leader hands over to its warm
// standby, and the new leader lists nothing (its caches are warm) and writes nothing to the
// settled objects (they are as it wants them). Figures are logged, not asserted.
func TestHandoverWithSettledVolumesListsNothing(t *testing.T) {
	w := newWorld(t, shortVolumes)
	var results []result
	for _, sc := range sidecars {
		// handover fails the test when the Lease does not pass to the standby or the
		// standby makes no call of the work's method.
		r := w.handover(sc, shortWindow)
		results = append(results, r)
		if len(r.req.lists) > 0 {
			t.Errorf("%s: the new leader listed %s in its first %v", sc.name, format(r.req.lists), shortWindow)
		}
		if len(r.req.settledWrites) > 0 {
			t.Errorf("%s: the new leader wrote to settled objects in its first %v: %s", sc.name, shortWindow, format(r.req.settledWrites))
		}
	}
	t.Log(table(shortVolumes, w.setupTime(), results))
}

// BenchmarkHandoverAt10000 is the handover of each sidecar with 10,000 settled volumes in
// its caches (and 20 fresh items, half in flight at the SIGTERM): the standby's first call
// after the leader's exit, the LISTs and writes (to settled objects in particular) of the
// new leader in its first 10 s, and the peak memory of both replicas.
func BenchmarkHandoverAt10000(b *testing.B) {
	metrics := map[string]float64{}
	for range b.N {
		w := newWorld(b, benchVolumes)
		metrics["setup-s"] += (w.driverSetup + w.apiSetup).Seconds()
		var results []result
		for _, sc := range sidecars {
			r := w.handover(sc, benchWindow)
			results = append(results, r)
			metrics[sc.name+"-takeover-s"] += r.takeover.Seconds()
			metrics[sc.name+"-work-after-lease-s"] += r.workAfterLease.Seconds()
			metrics[sc.name+"-lists"] += float64(sum(r.req.lists))
			metrics[sc.name+"-writes"] += float64(sum(r.req.writes))
			metrics[sc.name+"-settled-writes"] += float64(sum(r.req.settledWrites))
			metrics[sc.name+"-leader-MiB"] += float64(r.leaderRSS) / (1 << 20)
			metrics[sc.name+"-standby-MiB"] += float64(r.standbyRSS) / (1 << 20)
		}
		b.Log(table(benchVolumes, w.setupTime(), results))
	}
	for name, v := range metrics {
		b.ReportMetric(v/float64(b.N), name)
	}
}
