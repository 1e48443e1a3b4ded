package snapshotter

import (
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// Upstream's issue 1388: a slow driver answers CreateSnapshot with DeadlineExceeded for a
// while (having cut the snapshot all the same), the VolumeSnapshot is deleted meanwhile;
// once CreateSnapshot succeeds the snapshot must be recorded and then deleted, not left in
// the backend with its objects stuck.
func TestASnapshotDeletedWhileTheDriverIsSlowIsDeleted(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	claims := s.claims(1)
	if err := s.Driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateSnapshot, Code: codes.DeadlineExceeded,
		Times: 4, ApplyAnyway: true}); err != nil {
		t.Fatal(err)
	}
	s.start("replica-a")
	s.snapshot("slow", claims[0])
	s.WaitForCalls("a CreateSnapshot timed out", func(c []testdriver.Call) bool {
		for _, call := range testdriver.CallsOf(c, testdriver.MethodCreateSnapshot) {
			if call.Code == codes.DeadlineExceeded.String() {
				return true
			}
		}
		return false
	})
	s.deleteSnapshot("slow")
	if !s.settle() {
		t.Error("not settled within a minute")
	}
	if n := len(s.Driver.Snapshots()); n != 0 {
		t.Errorf("%d snapshots left in the backend: %v", n, s.Driver.Snapshots())
	}
	if n := len(s.volumeSnapshots()) + len(s.contents()); n != 0 {
		t.Errorf("%d VolumeSnapshots and contents left", n)
	}
}

// Upstream's pull request 1446: with many VolumeSnapshots deleted at once and everyone at
// upstream's default API budget (5 QPS, burst 10: the snapshotter and the
// snapshot-controller), no deletion is lost to client-side throttling: every snapshot is
// deleted in the backend and every object goes.
func TestDeletionsAreNotLostToThrottling(t *testing.T) {
	const n = 12
	s := newScenarioWith(t, testdriver.Config{})
	claims := s.claims(n)
	s.Start("replica-a", []string{"csi-sidecars", "snapshotter"})
	var names []string
	for i, c := range claims {
		names = append(names, fmt.Sprintf("snap-%02d", i))
		s.snapshot(names[i], c)
	}
	s.waitReady(names...)
	for _, name := range names {
		s.deleteSnapshot(name)
	}
	if !s.settle() {
		t.Error("not settled within a minute")
	}
	if got := len(s.Driver.Snapshots()); got != 0 {
		t.Errorf("%d of %d snapshots left in the backend", got, n)
	}
	if got := len(s.volumeSnapshots()) + len(s.contents()); got != 0 {
		t.Errorf("%d VolumeSnapshots and contents left", got)
	}
}
