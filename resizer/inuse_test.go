package resizer

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func podUsing(name, claim string) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name},
		Spec: v1.PodSpec{Volumes: []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{
			PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: claim},
		}}}},
		Status: v1.PodStatus{Phase: v1.PodRunning},
	}
}

// An offline-only driver refuses while a Pod uses the PVC: the resizer does not retry
// while the Pod runs, and retries as soon as it is deleted.
func TestInUseExpansionWaitsForThePod(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	id := f.createVolume("vol", gi(1))
	pvc, pv := boundPair("claim", id, "2Gi", "1Gi")
	f, c := newExpansionFixtureWith(t, f, expansionOpts{handleInUse: true}, pvc, pv, podUsing("app", "claim"))
	f.start()
	if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerExpandVolume, Code: codes.FailedPrecondition, Times: 1}); err != nil {
		t.Fatal(err)
	}
	if err := c.sync("ns/claim"); err != nil {
		t.Fatalf("in-use refusal with the Pod running returned %v, want nil (wait for the Pod)", err)
	}
	f.settle()
	if err := c.sync("ns/claim"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 1 {
		t.Fatalf("%d calls while the Pod still runs, want 1", n)
	}
	if !hasEvent(f.events(), "Warning VolumeResizeFailed") {
		t.Errorf("no VolumeResizeFailed event")
	}

	// Only the Pod's deletion may enqueue the PVC from here on.
	for c.queue.Len() > 0 {
		key, _ := c.queue.Get()
		c.queue.Done(key)
	}
	if err := f.kube.CoreV1().Pods("ns").Delete(context.Background(), "app", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	pods := f.factory.Core().V1().Pods().Informer().GetIndexer()
	err := wait.PollUntilContextTimeout(context.Background(), 5e6, 5e9, true, func(context.Context) (bool, error) {
		_, exists, err := pods.GetByKey("ns/app")
		return err == nil && !exists && c.queue.Len() > 0, nil
	})
	if err != nil {
		t.Fatal("deleting the Pod did not enqueue the PVC")
	}
	key, _ := c.queue.Get()
	c.queue.Done(key)
	if key != "ns/claim" {
		t.Fatalf("enqueued %q", key)
	}
	if err := c.sync(key); err != nil {
		t.Fatal(err)
	}
	if got := f.pvc("claim").Status.Capacity[v1.ResourceStorage]; got.String() != "2Gi" {
		t.Errorf("capacity %s after the Pod went away, want 2Gi", got.String())
	}
}

// Without --handle-volume-inuse-error no Pod informer is registered and the refusal is
// retried like any other final error.
func TestInUseHandlingOff(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	pvc, pv := boundPair("claim", "h", "2Gi", "1Gi")
	f, c := newExpansionFixtureWith(t, f, expansionOpts{}, pvc, pv)
	if c.inUse != nil {
		t.Fatal("in-use tracker built without the flag")
	}
	f.start()
	for typ := range f.factory.WaitForCacheSync(nil) {
		if typ.String() == "*v1.Pod" {
			t.Errorf("Pod informer started without --handle-volume-inuse-error")
		}
	}
}
