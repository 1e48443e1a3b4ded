package provisioner

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/util/workqueue"

	"github.com/csi-sidecars/csi-sidecars/internal/cachetest"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// queueNames records the names of the queues that report metrics to it.
type queueNames struct {
	mu    sync.Mutex
	names []string
}

type noopMetric struct{}

func (noopMetric) Inc()            {}
func (noopMetric) Dec()            {}
func (noopMetric) Set(float64)     {}
func (noopMetric) Observe(float64) {}

func (q *queueNames) NewDepthMetric(name string) workqueue.GaugeMetric {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.names = append(q.names, name)
	return noopMetric{}
}
func (*queueNames) NewAddsMetric(string) workqueue.CounterMetric           { return noopMetric{} }
func (*queueNames) NewLatencyMetric(string) workqueue.HistogramMetric      { return noopMetric{} }
func (*queueNames) NewWorkDurationMetric(string) workqueue.HistogramMetric { return noopMetric{} }
func (*queueNames) NewUnfinishedWorkSecondsMetric(string) workqueue.SettableGaugeMetric {
	return noopMetric{}
}
func (*queueNames) NewLongestRunningProcessorSecondsMetric(string) workqueue.SettableGaugeMetric {
	return noopMetric{}
}
func (*queueNames) NewRetriesMetric(string) workqueue.CounterMetric { return noopMetric{} }

// Every queue is the core's (lifecycle.NewQueue): client-go's workqueue metrics under
// upstream's names where upstream has the queue, and the sidecar's backlog.
func TestEveryQueueReportsItsMetricsUnderUpstreamsNamesAndItsBacklog(t *testing.T) {
	names := &queueNames{}
	backlog := &lifecycle.Backlog{}
	var o options
	if err := newFlagSet(&o).Parse(nil); err != nil {
		t.Fatal(err)
	}
	kube := fake.NewClientset()
	factory := informers.NewSharedInformerFactoryWithOptions(kube, 0, informers.WithTransform(cachetest.Transform()))
	c, err := newController(config{opts: o, driver: drv, kube: kube, queueMetrics: names, backlog: backlog}, factory)
	if err != nil {
		t.Fatal(err)
	}
	tracker, err := newCapacityTracker(capacityConfig{driver: drv, namespace: capNS, managedBy: capacityManagedBy, kube: kube, queueMetrics: names, backlog: backlog},
		factory, o.retryIntervalStart, o.retryIntervalMax)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"claims", "volumes", "provisioner-sources", "csistoragecapacity"} {
		if !slices.Contains(names.names, want) {
			t.Errorf("queues %v, want one named %q (the workqueue metric label)", names.names, want)
		}
	}
	c.claimQueue.Add("uid-1")
	c.sourceQueue.Add("pvc/ns/src")
	tracker.queue.Add(recomputeCapacities)
	waiting := map[string]int{}
	for _, q := range backlog.Now(time.Now()) {
		waiting[q.Queue] = q.Waiting
	}
	if diff := cmp.Diff(map[string]int{"claims": 1, "volumes": 0, "provisioner-sources": 1, "csistoragecapacity": 1}, waiting); diff != "" {
		t.Errorf("backlog (-want +got):\n%s", diff)
	}
}
