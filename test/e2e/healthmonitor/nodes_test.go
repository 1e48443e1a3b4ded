package healthmonitor

import (
	"context"
	"testing"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/util/retry"
)

// With --enable-node-watcher: a claim that a Pod on a node uses gets a NodeFailed event
// when the node is Terminated, NodeRecovered when it is Ready again, and NodeFailed once
// more when the node is deleted; a claim used on another node gets none.
func TestNodeWatcherReportsClaimsOnAFailedNode(t *testing.T) {
	s := newScenario(t, kube.Get(t), healthDriver())
	ctx := context.Background()
	s.createPair("a")
	s.createPair("b")
	failing, healthy := s.Namespace+"-failing", s.Namespace+"-healthy"
	for _, n := range []string{failing, healthy} {
		s.createNode(n)
	}
	// Pod admission needs the namespace's default ServiceAccount; no controller makes it.
	if _, err := s.Client.CoreV1().ServiceAccounts(s.Namespace).Create(ctx, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	s.createPod("app-a", failing, "a")
	s.createPod("app-b", healthy, "b")

	r := s.startReplica("r1", "--enable-node-watcher")
	s.WaitForHolder(s.leaseName, "r1")
	r.WaitReady(t) // the Node informer has both Nodes
	s.passes(1)

	events := func(claim, reason string) []v1.Event {
		list, err := s.Client.CoreV1().Events(s.Namespace).List(ctx, metav1.ListOptions{
			FieldSelector: fields.Set{"involvedObject.name": claim, "involvedObject.kind": "PersistentVolumeClaim", "reason": reason}.String()})
		if err != nil {
			t.Fatal(err)
		}
		return list.Items
	}
	wantFailed := "Pods: [ app-a ] consuming PVC: a in namespace: " + s.Namespace + " are now on a failed node: " + failing

	s.setNode(failing, v1.ConditionFalse, v1.NodeTerminated)
	s.WaitUntil("a NodeFailed event on claim a", func() bool { return len(events("a", "NodeFailed")) == 1 })
	ev := events("a", "NodeFailed")[0]
	if ev.Type != v1.EventTypeWarning || ev.Message != wantFailed || ev.Count != 1 {
		t.Errorf("NodeFailed event: type %s, count %d, message %q; want Warning, 1, %q", ev.Type, ev.Count, ev.Message, wantFailed)
	}
	if ev.Source.Component != "csi-pv-monitor-controller-"+s.Driver.DriverName() {
		t.Errorf("NodeFailed event from %q", ev.Source.Component)
	}

	s.setNode(failing, v1.ConditionTrue, v1.NodeRunning)
	s.WaitUntil("a NodeRecovered event on claim a", func() bool { return len(events("a", "NodeRecovered")) == 1 })
	if ev := events("a", "NodeRecovered")[0]; ev.Type != v1.EventTypeWarning || ev.Message != "Node: "+failing+" recovered" {
		t.Errorf("NodeRecovered event: type %s, message %q", ev.Type, ev.Message)
	}

	if err := s.Client.CoreV1().Nodes().Delete(ctx, failing, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the NodeFailed event of the deleted node", func() bool {
		ev := events("a", "NodeFailed")
		return len(ev) == 1 && ev[0].Count == 2
	})
	// A node list (--node-list-add-interval) and a few passes later, nothing more.
	s.passes(3)
	if ev := events("a", "NodeFailed"); len(ev) != 1 || ev[0].Count != 2 {
		t.Errorf("NodeFailed events after the deletion: %+v", ev)
	}
	for _, reason := range []string{"NodeFailed", "NodeRecovered"} {
		if ev := events("b", reason); len(ev) != 0 {
			t.Errorf("claim b, used on a Ready node, has %s events: %+v", reason, ev)
		}
	}
}

// createNode creates a Ready Node, deleted at cleanup.
func (s *scenario) createNode(name string) {
	s.T.Helper()
	ctx := context.Background()
	node, err := s.Client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	s.T.Cleanup(func() { _ = s.Client.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	node.Status.Phase = v1.NodeRunning
	node.Status.Conditions = []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady", LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}}
	if _, err := s.Client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		s.T.Fatal(err)
	}
}

// setNode sets a Node's Ready condition and phase, as its kubelet and the node lifecycle
// controller would.
func (s *scenario) setNode(name string, ready v1.ConditionStatus, phase v1.NodePhase) {
	s.T.Helper()
	nodes := s.Client.CoreV1().Nodes()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := nodes.Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		node.Status.Phase = phase
		node.Status.Conditions = []v1.NodeCondition{{Type: v1.NodeReady, Status: ready, Reason: "Test", LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}}
		_, err = nodes.UpdateStatus(context.Background(), node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		s.T.Fatal(err)
	}
}

// createPod creates a Pod bound to node that uses claim, as the scheduler leaves it.
func (s *scenario) createPod(name, node, claim string) {
	s.T.Helper()
	_, err := s.Client.CoreV1().Pods(s.Namespace).Create(context.Background(), &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PodSpec{
			NodeName:   node,
			Containers: []v1.Container{{Name: "app", Image: "registry.example/app:v1", VolumeMounts: []v1.VolumeMount{{Name: "data", MountPath: "/data"}}}},
			Volumes: []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{
				PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
}
