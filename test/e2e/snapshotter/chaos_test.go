package snapshotter

import (
	"fmt"
	"syscall"
	"testing"
	"time"

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
	const rounds, perRound = 3, 6
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateSnapshot: 1500 * time.Millisecond}})
	claims := s.claims(rounds * perRound)
	replicas := map[string]*e2e.Replica{}
	for _, name := range []string{"replica-a", "replica-b", "replica-c"} {
		replicas[name] = s.start(name, shortLease...)
	}
	t0 := time.Now()
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
		// The leader is whoever calls the driver for this round's snapshots (the Lease may
		// still name a dead leader, whose successor under its name waits, P10).
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
		leader.Signal(t, syscall.SIGKILL)
		leader.Wait(t, 10*time.Second)
		for _, name := range batch[:perRound/2] {
			s.deleteSnapshot(name)
		}
		// Back under its own name (a restarted container) or as a new Pod.
		name := leaderName
		if round%2 == 1 {
			name = fmt.Sprintf("%s-%d", leaderName, round)
		}
		delete(replicas, leaderName)
		replicas[name] = s.start(name, shortLease...)
		t.Logf("round %d at %s: killed %s, restarted as %s", round, sinceStart(t0), leaderName, name)
	}
	if !s.settle() {
		t.Error("not settled within a minute: snapshots stuck or leaked")
	}
	if l := s.leaked(); len(l) != 0 {
		t.Errorf("%d leaked snapshots: %v", len(l), l)
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("%d overlapping calls: %v", len(o), o)
	}
	want := rounds * (perRound - perRound/2)
	left := s.volumeSnapshots()
	if len(left) != want {
		t.Errorf("%d VolumeSnapshots left, want %d", len(left), want)
	}
	for name, vs := range left {
		if vs.DeletionTimestamp != nil || vs.Status == nil || vs.Status.ReadyToUse == nil || !*vs.Status.ReadyToUse {
			t.Errorf("VolumeSnapshot %s stuck: deleting %v, status %+v", name, vs.DeletionTimestamp != nil, vs.Status)
		}
	}
	if got := len(s.Driver.Snapshots()); got != want {
		t.Errorf("backend holds %d snapshots, want %d", got, want)
	}
}
