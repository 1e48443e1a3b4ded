package snapshotter

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testdriver"
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

// runSnapChaos is chaos_test.go's scenario with rounds rounds: three replicas; in each
// round the leader is SIGKILLed while its CreateSnapshot calls run in the driver, half of
// the round's VolumeSnapshots are deleted during the failover, and the killed replica comes
// back under its own identity or a new one. It counts what is off rather than failing.
func runSnapChaos(t testing.TB, rounds int) snapChaos {
	t.Helper()
	const perRound = 6
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateSnapshot: 1500 * time.Millisecond}})
	claims := s.claims(rounds * perRound)
	replicas := map[string]*e2e.Replica{}
	for _, name := range []string{"replica-a", "replica-b", "replica-c"} {
		replicas[name] = s.start(name, shortLease...)
	}
	var lastKill time.Time
	next := 0
	for round := range rounds {
		var batch []string
		created := time.Now()
		for range perRound {
			name := fmt.Sprintf("snap-%02d", next)
			s.snapshot(name, claims[next])
			batch = append(batch, name)
			next++
		}
		var leaderName string
		s.WaitForCalls("this round's CreateSnapshot in flight", func(c []testdriver.Call) bool {
			for name, r := range replicas {
				for _, call := range e2e.CallsOn(c, r, testdriver.MethodCreateSnapshot) {
					if call.Start.After(created) && call.End.IsZero() {
						leaderName = name
						return true
					}
				}
			}
			return false
		})
		leader := replicas[leaderName]
		lastKill = leader.Signal(t, syscall.SIGKILL)
		leader.Wait(t, 10*time.Second)
		for _, name := range batch[:perRound/2] {
			s.deleteSnapshot(name)
		}
		name := leaderName
		if round%2 == 1 {
			name = fmt.Sprintf("%s-%d", leaderName, round)
		}
		delete(replicas, leaderName)
		replicas[name] = s.start(name, shortLease...)
		t.Logf("round %d: killed %s, restarted as %s", round, leaderName, name)
	}
	var c snapChaos
	c.settled = s.settle()
	c.settle = time.Since(lastKill)
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
