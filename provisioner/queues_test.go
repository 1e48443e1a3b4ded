package provisioner

import (
	"slices"
	"sync"
	"testing"

	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/util/workqueue"
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

func TestTheClaimAndVolumeQueuesReportUnderUpstreamsNames(t *testing.T) {
	names := &queueNames{}
	var o options
	if err := newFlagSet(&o).Parse(nil); err != nil {
		t.Fatal(err)
	}
	kube := fake.NewClientset()
	if _, err := newController(config{opts: o, driver: drv, kube: kube, queueMetrics: names}, informers.NewSharedInformerFactory(kube, 0)); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"claims", "volumes"} {
		if !slices.Contains(names.names, want) {
			t.Errorf("queues %v, want one named %q (upstream's workqueue metric label)", names.names, want)
		}
	}
}
