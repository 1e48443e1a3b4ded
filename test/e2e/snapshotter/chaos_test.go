package snapshotter

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// No snapshot leaks, whatever crashes: three replicas; in each round the leader is killed
// (SIGKILL) while its CreateSnapshot calls run in the driver (which finishes them anyway),
// half of the round's VolumeSnapshots are deleted during the failover, and the killed
// replica comes back under its own identity (a container restarted in its pod) or a new
// one. In the end every snapshot the driver took is recorded on a content or deleted,
// every VolumeSnapshot left is ready, none is stuck being deleted, and no two calls for
// one snapshot overlapped. Without the being-created record on the content before
// CreateSnapshot, the snapshots of the VolumeSnapshots deleted during a failover leak.
func TestChaosSIGKILLWhileCreateSnapshotRunsLeaksNothing(t *testing.T) {
	c := runSnapChaos(t, 3)
	if !c.settled {
		t.Error("not settled within a minute: snapshots stuck or leaked")
	}
	if c.leaked != 0 {
		t.Errorf("%d leaked snapshots", c.leaked)
	}
	if c.overlaps != 0 {
		t.Errorf("%d overlapping calls", c.overlaps)
	}
	if c.left != c.want || c.stuck != 0 {
		t.Errorf("%d VolumeSnapshots left (want %d), %d of them stuck", c.left, c.want, c.stuck)
	}
}

// snapChaos is what one chaos run observed.
type snapChaos struct {
	leaked, overlaps, stuck int
	// left are the VolumeSnapshots left at the end; want is how many should be.
	left, want int
	settled    bool
	// settle: the last kill to the whole run settled (or given up on, after a minute).
	settle time.Duration
}

// runSnapChaos is chaos_test.go's scenario with rounds rounds of e2e.ChaosRounds: in each
// round the leader is SIGKILLed while its CreateSnapshot calls run in the driver, half of
// the round's VolumeSnapshots are deleted during the failover, and the killed replica comes
// back under its own identity or a new one. Rounds do not wait to settle; the run settles
// once, after the last kill. It counts what is off rather than failing.
func runSnapChaos(t testing.TB, rounds int) snapChaos {
	t.Helper()
	const perRound = 6
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateSnapshot: 1500 * time.Millisecond}})
	claims := s.claims(rounds * perRound)
	var batch []string
	var created time.Time
	run := &e2e.ChaosRounds{S: s.Scenario, Lease: s.leaseName,
		Start: func(name, id string) *e2e.Replica {
			return s.start(name, append([]string{"--leader-election-identity=" + id}, shortLease...)...)
		},
		Work: func(round int) {
			batch, created = nil, time.Now()
			for i := round * perRound; i < (round+1)*perRound; i++ {
				name := fmt.Sprintf("snap-%02d", i)
				s.snapshot(name, claims[i])
				batch = append(batch, name)
			}
		},
		// The leader is whoever runs a CreateSnapshot started in this round: one of this
		// round's or of an earlier one, nothing settles in between.
		InFlight: func(_ int, calls []testdriver.Call, r *e2e.Replica) bool {
			return slices.ContainsFunc(e2e.CallsOn(calls, r, testdriver.MethodCreateSnapshot), func(c testdriver.Call) bool {
				return c.Start.After(created) && !c.Done()
			})
		},
		Leaderless: func(int) {
			for _, name := range batch[:perRound/2] {
				s.deleteSnapshot(name)
			}
		},
	}
	run.Run(rounds)
	var c snapChaos
	c.settled = s.settle()
	c.settle = time.Since(run.LastKill)
	c.leaked = len(s.leaked())
	c.overlaps = len(s.Driver.Overlaps())
	c.want = rounds * (perRound - perRound/2)
	left := s.volumeSnapshots()
	c.left = len(left)
	for _, vs := range left {
		if vs.DeletionTimestamp != nil || vs.Status == nil || !ptr.Deref(vs.Status.ReadyToUse, false) {
			c.stuck++
		}
	}
	return c
}
