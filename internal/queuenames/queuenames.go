// Package queuenames is a test helper: a client-go workqueue metrics provider that records
// the names of the queues reporting to it, so tests can check the names dashboards see.
package queuenames

import (
	"slices"
	"sync"

	"k8s.io/client-go/util/workqueue"
)

// Recorder records the names of the queues that report to it, in order.
type Recorder struct {
	mu    sync.Mutex
	names []string
}

// Names returns the names recorded so far.
func (r *Recorder) Names() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.names)
}

// NewDepthMetric implements workqueue.MetricsProvider; every queue asks for it once.
func (r *Recorder) NewDepthMetric(name string) workqueue.GaugeMetric {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.names = append(r.names, name)
	return noop{}
}

func (*Recorder) NewAddsMetric(string) workqueue.CounterMetric           { return noop{} }
func (*Recorder) NewLatencyMetric(string) workqueue.HistogramMetric      { return noop{} }
func (*Recorder) NewWorkDurationMetric(string) workqueue.HistogramMetric { return noop{} }
func (*Recorder) NewUnfinishedWorkSecondsMetric(string) workqueue.SettableGaugeMetric {
	return noop{}
}
func (*Recorder) NewLongestRunningProcessorSecondsMetric(string) workqueue.SettableGaugeMetric {
	return noop{}
}
func (*Recorder) NewRetriesMetric(string) workqueue.CounterMetric { return noop{} }

type noop struct{}

func (noop) Inc()            {}
func (noop) Dec()            {}
func (noop) Set(float64)     {}
func (noop) Observe(float64) {}
