package snapshotter

import (
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
)

// The benchmarks of `make bench` print figures (b.ReportMetric) and assert none: a failed
// wait still ends the benchmark, but a leak, an overlap or a slow takeover is a figure.

const (
	// benchRepeats is how many failovers each BenchmarkFailover variant runs, for a mean
	// and a max.
	benchRepeats = 5
	// benchChaosRounds is BenchmarkSnapshotChaos's rounds (the test runs 3).
	benchChaosRounds = 8
)

// repeat is a testing.TB for one repetition inside a benchmark: what the repetition
// registers with Cleanup (its snapshot-controller, replicas, driver sockets) runs when it
// ends rather than when the benchmark does, so that no snapshot-controller of an earlier
// repetition (they watch every namespace) acts on a later one's VolumeSnapshots.
type repeat struct {
	testing.TB
	mu       sync.Mutex
	cleanups []func()
}

func newRepeat(b *testing.B) *repeat {
	r := &repeat{TB: b}
	b.Cleanup(r.done) // a repetition that failed half-way still cleans up
	return r
}

func (r *repeat) Cleanup(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cleanups = append(r.cleanups, f)
}

// done runs the cleanups registered so far, last first; it may be called again.
func (r *repeat) done() {
	r.mu.Lock()
	fs := r.cleanups
	r.cleanups = nil
	r.mu.Unlock()
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}

// BenchmarkFailover hands the snapshotter's Lease over while CreateSnapshot calls (2 s
// each) run on the leader, benchRepeats times per signal, and reports mean and max:
//
//   - SIGTERM: drain (signal to exit: the calls in flight finish and are recorded), takeover
//     (the leader's exit to the standby's first CreateSnapshot; the Lease is released, so
//     the target is < 0.3 s), all-ready (signal to every VolumeSnapshot ready).
//   - SIGKILL (lease 6 s, renew deadline 4 s, retry 1 s): nothing is released, so takeover
//     is bounded by the Lease's expiry: up to the lease duration after the last renewal
//     (6 s) plus a retry period, not by anything the sidecar does; the driver finishes the
//     dead leader's calls on its own.
//
// Overlapping calls and leaked snapshots are reported too (the tests assert them).
func BenchmarkFailover(b *testing.B) {
	for _, v := range []struct {
		name  string
		sig   syscall.Signal
		extra []string
	}{
		{"SIGTERM", syscall.SIGTERM, nil},
		{"SIGKILL", syscall.SIGKILL, shortLease},
	} {
		b.Run(v.name, func(b *testing.B) {
			var drain, takeover, allReady []time.Duration
			var inFlight, overlaps, leaked, exitNonZero int
			for range b.N {
				for i := range benchRepeats {
					r := newRepeat(b)
					f := runSnapFailover(r, v.sig, v.extra...)
					r.done()
					exit := fmt.Sprintf("drain %v, exit %d", f.drain.Round(time.Millisecond), f.exitCode)
					if v.sig == syscall.SIGKILL {
						exit = "killed"
					}
					b.Logf("%s run %d: %d in flight, %s, takeover %v, all ready %v after the signal, %d overlaps, %d leaked",
						v.name, i, f.inFlight, exit, f.takeover.Round(time.Millisecond),
						f.allReady.Round(time.Millisecond), len(f.overlaps), len(f.leaked))
					drain, takeover, allReady = append(drain, f.drain), append(takeover, f.takeover), append(allReady, f.allReady)
					inFlight += f.inFlight
					overlaps += len(f.overlaps)
					leaked += len(f.leaked)
					if f.exitCode != 0 {
						exitNonZero++
					}
				}
			}
			runs := float64(len(takeover))
			report := func(ds []time.Duration, unit string) {
				mean, longest := e2e.MeanAndLongest(ds)
				b.ReportMetric(mean, unit+"-s")
				b.ReportMetric(longest, unit+"-max-s")
			}
			if v.sig == syscall.SIGTERM {
				report(drain, "drain")
				b.ReportMetric(float64(exitNonZero), "nonzero-exits")
			}
			report(takeover, "takeover")
			report(allReady, "all-ready")
			b.ReportMetric(float64(inFlight)/runs, "in-flight")
			b.ReportMetric(float64(overlaps), "overlaps")
			b.ReportMetric(float64(leaked), "leaked")
		})
	}
}

// BenchmarkSnapshotChaos is the snapshot chaos run with benchChaosRounds rounds (the test
// runs 3): snapshots leaked, overlapping calls, VolumeSnapshots stuck (not ready, or being
// deleted) and left over, and the time from the last SIGKILL until the run settled. That
// is the only time to settle there is: each round kills the new leader as soon as its first
// call of the round starts, about when it took over, so no leader finishes earlier rounds'
// work and nothing settles before the kills stop. From the last kill it takes the Lease's
// expiry (lease 6 s) plus a CreateSnapshot (1.5 s) and the writes after it.
func BenchmarkSnapshotChaos(b *testing.B) {
	for range b.N {
		r := newRepeat(b)
		c := runSnapChaos(r, benchChaosRounds)
		r.done()
		b.Logf("snapshot chaos: %d rounds, %d VolumeSnapshots left (want %d), settled %v %v after the last kill; %d leaked, %d overlaps, %d stuck",
			benchChaosRounds, c.left, c.want, c.settled, c.settle.Round(time.Millisecond), c.leaked, c.overlaps, c.stuck)
		b.ReportMetric(float64(c.leaked), "leaked-snapshots")
		b.ReportMetric(float64(c.overlaps), "overlaps")
		b.ReportMetric(float64(c.stuck), "stuck-snapshots")
		b.ReportMetric(float64(c.left-c.want), "extra-snapshots")
		settled := 0.0
		if c.settled {
			settled = 1
		}
		b.ReportMetric(settled, "settled")
		b.ReportMetric(c.settle.Seconds(), "settle-s")
	}
}
