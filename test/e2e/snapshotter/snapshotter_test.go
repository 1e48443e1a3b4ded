package snapshotter

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The whole life of a dynamic snapshot under the real snapshot-controller: taken with
// upstream's name and the class's parameters, ready with its size, deleted with its
// VolumeSnapshot; nothing left in the backend.
func TestSnapshotsAreTakenRecordedAndDeleted(t *testing.T) {
	s := newScenario(t, testdriver.Config{SnapshotReadyAfterPolls: 2})
	claims := s.claims(3)
	r := s.start("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	var names []string
	uids := map[string]string{}
	for i, c := range claims {
		name := fmt.Sprintf("snap-%d", i)
		uids[name] = string(s.snapshot(name, c).UID)
		names = append(names, name)
	}
	s.waitReady(names...)
	for name, vs := range s.volumeSnapshots() {
		if vs.Status.RestoreSize == nil || vs.Status.RestoreSize.IsZero() || vs.Status.CreationTime == nil {
			t.Errorf("%s: status %+v, want restore size and creation time", name, vs.Status)
		}
	}
	for _, c := range s.contents() {
		if _, ok := c.Annotations["snapshot.storage.kubernetes.io/volumesnapshot-being-created"]; ok {
			t.Errorf("content %s keeps the being-created annotation once ready", c.Name)
		}
	}
	creates := e2e.CallsOn(s.Driver.Journal(), r, testdriver.MethodCreateSnapshot)
	for _, c := range creates {
		if !strings.HasPrefix(c.SnapshotName, "snapshot-") {
			t.Errorf("CreateSnapshot name %q, want upstream's snapshot-<VolumeSnapshot UID>", c.SnapshotName)
		}
	}
	for name, uid := range uids {
		found := false
		for _, c := range creates {
			found = found || c.SnapshotName == "snapshot-"+uid
		}
		if !found {
			t.Errorf("no CreateSnapshot named after %s's UID", name)
		}
	}
	// Not ready at first: polled by calling CreateSnapshot again, as upstream.
	if len(creates) <= len(names) {
		t.Errorf("%d CreateSnapshot calls for %d snapshots ready after 2 answers each: readiness not polled", len(creates), len(names))
	}
	if len(s.Driver.Snapshots()) != len(names) {
		t.Errorf("backend holds %d snapshots, want %d", len(s.Driver.Snapshots()), len(names))
	}
	for _, n := range names {
		s.deleteSnapshot(n)
	}
	s.WaitUntil("the backend's snapshots deleted with their VolumeSnapshots", func() bool {
		return len(s.Driver.Snapshots()) == 0 && len(s.contents()) == 0 && len(s.volumeSnapshots()) == 0
	})
	if n := len(s.Driver.Overlaps()); n != 0 {
		t.Errorf("%d overlapping calls", n)
	}
}

// The snapshotter secret of the class reaches CreateSnapshot and DeleteSnapshot, through
// the annotations the snapshot-controller puts on the content.
func TestTheSnapshotterSecretReachesTheDriver(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	if _, err := s.Client.CoreV1().Secrets(s.Namespace).Create(s.ctx(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "snap-creds"}, Data: map[string][]byte{"create-key": []byte("x")}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	class := &snapv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: s.Namespace + "-secret"}, Driver: s.Driver.DriverName(),
		DeletionPolicy: snapv1.VolumeSnapshotContentDelete, Parameters: map[string]string{
			"csi.storage.k8s.io/snapshotter-secret-name":      "snap-creds",
			"csi.storage.k8s.io/snapshotter-secret-namespace": "${volumesnapshot.namespace}",
		}}
	if _, err := s.snaps.SnapshotV1().VolumeSnapshotClasses().Create(s.ctx(), class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.class = class.Name
	claims := s.claims(1)
	r := s.start("replica-a")
	s.snapshot("secret", claims[0])
	s.waitReady("secret")
	s.deleteSnapshot("secret")
	s.WaitUntil("the snapshot deleted", func() bool { return len(s.Driver.Snapshots()) == 0 })
	for _, m := range []string{testdriver.MethodCreateSnapshot, testdriver.MethodDeleteSnapshot} {
		calls := e2e.CallsOn(s.Driver.Journal(), r, m)
		if len(calls) == 0 {
			t.Errorf("no %s", m)
		}
		for _, c := range calls {
			if c.SecretKeys != "create-key" {
				t.Errorf("%s got secret keys %q, want the class's snapshotter secret", m, c.SecretKeys)
			}
		}
	}
}

// P1, P2, P7 for the snapshotter: SIGTERM lets every CreateSnapshot in flight finish and be
// recorded by the old leader, which exits 0 and releases the Lease; the warm standby's first
// call comes at once and takes the rest; nothing overlaps, nothing leaks.
func TestSIGTERMDuringCreateSnapshotFailsOverWithoutLoss(t *testing.T) {
	f := runSnapFailover(t, syscall.SIGTERM)
	if f.exitCode != 0 {
		t.Errorf("leader exit code %d, want 0", f.exitCode)
	}
	for _, c := range f.leaderCalls {
		if c.Start.After(f.signalled) {
			t.Errorf("CreateSnapshot %s started %v after the signal", c.SnapshotName, c.Start.Sub(f.signalled))
		}
		if c.Code != "OK" || c.Canceled {
			t.Errorf("CreateSnapshot %s on the leader ended %s (canceled %v), want it finished", c.SnapshotName, c.Code, c.Canceled)
		}
	}
	t.Logf("drain %v, standby's first CreateSnapshot %v after the leader's exit",
		f.drain.Round(time.Millisecond), f.takeover.Round(time.Millisecond))
	if f.holder != "replica-b" {
		t.Errorf("Lease holder %q, want replica-b", f.holder)
	}
	if len(f.leaked) != 0 {
		t.Errorf("leaked snapshots %v", f.leaked)
	}
	if len(f.overlaps) != 0 {
		t.Errorf("%d overlapping calls: %v", len(f.overlaps), f.overlaps)
	}
}

const (
	// failoverSnapshots is twice failoverWorkers: half are in flight on the leader at the
	// signal, half are left for the standby.
	failoverSnapshots = 12
	failoverWorkers   = 6
	failoverLatency   = 2 * time.Second
)

// snapFailover is what one failover run observed.
type snapFailover struct {
	signalled time.Time
	exitCode  int
	// drain: signal to the leader's exit. takeover: the leader's exit to the standby's
	// first CreateSnapshot. allReady: signal to every VolumeSnapshot ready.
	drain, takeover, allReady time.Duration
	// inFlight: the leader's CreateSnapshot calls running at the signal; leaderCalls: all
	// of them, once it exited.
	inFlight    int
	leaderCalls []testdriver.Call
	// holder of the Lease, overlaps and leaked snapshots once every VolumeSnapshot is
	// ready.
	holder   string
	overlaps []testdriver.Overlap
	leaked   []string
}

// runSnapFailover is the failover scenario of TestSIGTERMDuringCreateSnapshotFailsOverWithoutLoss
// and BenchmarkFailover: two snapshotter replicas (replica-a leading, replica-b warm),
// failoverSnapshots VolumeSnapshots with a CreateSnapshot of failoverLatency, sig sent to
// the leader while failoverWorkers calls run on it; it waits until the standby took over
// and every VolumeSnapshot is ready, and reports what it saw rather than failing.
func runSnapFailover(t testing.TB, sig syscall.Signal, extra ...string) snapFailover {
	t.Helper()
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateSnapshot: failoverLatency}})
	claims := s.claims(failoverSnapshots)
	flags := append([]string{fmt.Sprintf("--worker-threads=%d", failoverWorkers)}, extra...)
	leader := s.start("replica-a", flags...)
	s.WaitForHolder(s.leaseName, "replica-a")
	leader.WaitReady(t)
	backup := s.start("replica-b", flags...)
	backup.WaitReady(t)
	var names []string
	for i, c := range claims {
		names = append(names, fmt.Sprintf("snap-%02d", i))
		s.snapshot(names[i], c)
	}
	s.WaitForCalls("CreateSnapshot calls in flight on the leader", func(c []testdriver.Call) bool {
		return e2e.Running(e2e.CallsOn(c, leader, testdriver.MethodCreateSnapshot)) == failoverWorkers
	})
	var f snapFailover
	f.signalled = leader.Signal(t, sig)
	f.inFlight = e2e.Running(e2e.CallsOn(s.Driver.Journal(), leader, testdriver.MethodCreateSnapshot))
	f.exitCode = leader.Wait(t, 30*time.Second)
	f.drain = leader.ExitedAt.Sub(f.signalled)
	f.leaderCalls = e2e.CallsOn(s.Driver.Journal(), leader, testdriver.MethodCreateSnapshot)
	s.WaitForCalls("the standby's first CreateSnapshot", func(c []testdriver.Call) bool {
		return len(e2e.CallsOn(c, backup, testdriver.MethodCreateSnapshot)) > 0
	})
	f.takeover = e2e.CallsOn(s.Driver.Journal(), backup, testdriver.MethodCreateSnapshot)[0].Start.Sub(leader.ExitedAt)
	s.waitReady(names...)
	f.allReady = time.Since(f.signalled)
	f.holder = e2e.Holder(s.Lease(s.leaseName))
	f.overlaps = s.Driver.Overlaps()
	f.leaked = s.leaked()
	return f
}
