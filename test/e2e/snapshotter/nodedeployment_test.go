package snapshotter

import (
	"testing"

	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// --node-deployment: one snapshotter per node, without leader election, serves only the
// contents the snapshot-controller labelled with its node ($NODE_NAME), as upstream's.
func TestNodeDeploymentServesOnlyItsNodesContents(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	s.claims(1)
	volumes := s.Driver.Volumes()
	if len(volumes) != 1 {
		t.Fatalf("%d volumes in the backend", len(volumes))
	}
	byNode := map[string]string{"node-a": "", "node-b": "", "": ""} // node -> content name
	for node := range byNode {
		// Named so that node-a's sorts last: with one worker, a snapshotter that did not
		// filter would check the others first.
		suffix := map[string]string{"node-b": "1-node-b", "": "2-unlabelled", "node-a": "3-node-a"}[node]
		snap, err := s.Driver.TakeSnapshot("pre-"+suffix, volumes[0].ID)
		if err != nil {
			t.Fatal(err)
		}
		content := &snapv1.VolumeSnapshotContent{
			ObjectMeta: metav1.ObjectMeta{Name: s.Namespace + "-pre-" + suffix},
			Spec: snapv1.VolumeSnapshotContentSpec{
				Driver: s.Driver.DriverName(), DeletionPolicy: snapv1.VolumeSnapshotContentRetain,
				Source:            snapv1.VolumeSnapshotContentSource{SnapshotHandle: ptr.To(snap.ID)},
				VolumeSnapshotRef: corev1.ObjectReference{Namespace: s.Namespace, Name: "unbound-" + suffix},
			},
		}
		if node != "" {
			content.Labels = map[string]string{"snapshot.storage.kubernetes.io/managed-by": node}
		}
		if _, err := s.snaps.SnapshotV1().VolumeSnapshotContents().Create(s.ctx(), content, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		byNode[node] = content.Name
	}
	t.Setenv("NODE_NAME", "node-a")
	r := s.start("node-a", "--node-deployment", "--leader-election=false", "--worker-threads=1")
	s.WaitUntil("node-a's content checked", func() bool {
		c, err := s.snaps.SnapshotV1().VolumeSnapshotContents().Get(s.ctx(), byNode["node-a"], metav1.GetOptions{})
		return err == nil && c.Status != nil && ptr.Deref(c.Status.ReadyToUse, false)
	})
	// The others are not this node's: never checked.
	for _, node := range []string{"node-b", ""} {
		c, err := s.snaps.SnapshotV1().VolumeSnapshotContents().Get(s.ctx(), byNode[node], metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if c.Status != nil {
			t.Errorf("content of node %q checked by node-a's snapshotter: %+v", node, c.Status)
		}
	}
	if !r.Running() {
		t.Errorf("node-a's snapshotter exited %d", r.ExitCode)
	}
}

// Upstream refuses a node deployment with leader election, or without $NODE_NAME: exit 2
// with the flag's name, before anything connects.
func TestNodeDeploymentRefusesLeaderElectionAndAMissingNodeName(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	t.Setenv("NODE_NAME", "")
	r := s.start("no-node", "--node-deployment", "--leader-election=false")
	if code := r.Wait(t, 30e9); code != 2 {
		t.Errorf("without $NODE_NAME: exit %d, want 2", code)
	}
	t.Setenv("NODE_NAME", "node-a")
	r = s.start("with-election", "--node-deployment")
	if code := r.Wait(t, 30e9); code != 2 {
		t.Errorf("with --leader-election: exit %d, want 2", code)
	}
}
