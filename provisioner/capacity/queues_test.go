package capacity

import (
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/csi-sidecars/csi-sidecars/internal/queuenames"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// The tracker's queue is the core's (lifecycle.NewQueue): client-go's workqueue metrics
// under upstream's name, and the sidecar's backlog.
func TestTheQueueReportsItsMetricsUnderUpstreamsNameAndItsBacklog(t *testing.T) {
	names := &queuenames.Recorder{}
	backlog := &lifecycle.Backlog{}
	kube := fake.NewClientset()
	factory := informers.NewSharedInformerFactory(kube, 0)
	tracker, err := New(Config{Driver: drv, Namespace: capNS, ManagedBy: capacityManagedBy, Kube: kube, QueueMetrics: names, Backlog: backlog},
		factory, time.Second, 5*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if want := "csistoragecapacity"; !slices.Contains(names.Names(), want) {
		t.Errorf("queues %v, want one named %q (the workqueue metric label)", names.Names(), want)
	}
	tracker.queue.Add(recomputeCapacities)
	waiting := map[string]int{}
	for _, q := range backlog.Now(time.Now()) {
		waiting[q.Queue] = q.Waiting
	}
	if diff := cmp.Diff(map[string]int{"csistoragecapacity": 1}, waiting); diff != "" {
		t.Errorf("backlog (-want +got):\n%s", diff)
	}
}
