package lifecycle

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"k8s.io/client-go/util/workqueue"
)

// A queue's backlog counts the items ready and not yet taken by a worker, and the age of
// the oldest; an item added with a delay waits only once its delay is over.
func TestQueueBacklog(t *testing.T) {
	b := &Backlog{sidecar: "test"}
	q := NewQueue[string](QueueOptions{Name: "test-backlog", RetryStart: time.Hour, RetryMax: time.Hour, Backlog: b})
	defer q.ShutDown()
	start := time.Now()
	q.Add("a")
	q.Add("b")
	q.AddRateLimited("later") // an hour from now
	got := b.Now(start.Add(2 * time.Second))
	if len(got) != 1 || got[0].Queue != "test-backlog" || got[0].Waiting != 2 || got[0].Oldest < time.Second {
		t.Fatalf("backlog %+v, want 2 waiting, the oldest about 2s old", got)
	}
	item, _ := q.Get()
	q.Done(item)
	if got := b.Now(time.Now()); got[0].Waiting != 1 {
		t.Errorf("backlog %+v after a worker took one, want 1 waiting", got)
	}
	if got := b.Now(start.Add(2 * time.Hour)); got[0].Waiting != 2 {
		t.Errorf("backlog %+v once the delay is over, want 2 waiting", got)
	}
	q.ShutDown()
	q.Add("after") // an informer's event during the drain: the workqueue drops it
	if got := b.Now(time.Now()); got[0].Waiting != 0 || got[0].Oldest != 0 {
		t.Errorf("backlog %+v after shutdown, want none", got)
	}
}

// A standby fills its queues, so that it starts warm (P7), but its queue figures must not
// say it waits for anything: over hours of standing by, client-go's workqueue_depth, adds and
// queue waits and the core's backlog stay at zero. Once it leads they describe its own work,
// each wait counted from the moment it leads.
func TestStandbyQueuesShowNoWorkUntilTheyLead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		figures := &queueFigures{}
		b := &Backlog{sidecar: "test", standby: true}
		q := NewQueue[string](QueueOptions{Name: "test-standby", RetryStart: time.Second, RetryMax: time.Minute, Metrics: figures, Backlog: b})
		defer q.ShutDown()
		for i := range 50 {
			q.Add(fmt.Sprintf("item-%d", i))
		}
		q.AddAfter("due-while-standing-by", time.Hour)
		q.AddAfter("due-after-the-takeover", 4*time.Hour)

		for range 3 {
			time.Sleep(time.Hour)
			synctest.Wait()
			if depth, adds, waits := figures.now(); depth != 0 || adds != 0 || len(waits) != 0 {
				t.Fatalf("standing by: workqueue depth %v, adds %v, %d queue waits; want none", depth, adds, len(waits))
			}
			if got := b.Now(time.Now()); len(got) != 1 || got[0].Waiting != 0 || got[0].Oldest != 0 {
				t.Fatalf("standing by: backlog %+v, want none waiting", got)
			}
		}

		b.lead()
		tookOver := time.Now()
		synctest.Wait()
		if depth, adds, _ := figures.now(); depth != 51 || adds != 51 {
			t.Errorf("leading: workqueue depth %v, adds %v; want the 51 items due", depth, adds)
		}
		time.Sleep(2 * time.Second) // the workers come
		if got := b.Now(time.Now()); got[0].Waiting != 51 || got[0].Oldest != 2*time.Second {
			t.Errorf("leading: backlog %+v, want 51 waiting, the oldest since the takeover 2s ago", got)
		}
		for range 51 {
			item, _ := q.Get()
			q.Done(item)
		}
		if _, _, waits := figures.now(); len(waits) != 51 || slices.Max(waits) != 2 {
			t.Errorf("leading: queue waits %v; want 51 of 2s, counted from the takeover", waits)
		}
		time.Sleep(4*time.Hour - time.Since(tookOver) + 3*time.Hour)
		synctest.Wait()
		if depth, adds, _ := figures.now(); depth != 1 || adds != 52 {
			t.Errorf("after the last delay: workqueue depth %v, adds %v; want the delayed item queued when due", depth, adds)
		}
	})
}

// queueFigures is a workqueue metrics provider that keeps the figures of one queue.
type queueFigures struct {
	mu    sync.Mutex
	depth float64
	adds  float64
	waits []float64 // seconds
}

func (f *queueFigures) now() (depth, adds float64, waits []float64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.depth, f.adds, slices.Clone(f.waits)
}

func (f *queueFigures) NewDepthMetric(string) workqueue.GaugeMetric {
	return figure{f: f, add: func(d float64) { f.depth += d }}
}
func (f *queueFigures) NewAddsMetric(string) workqueue.CounterMetric {
	return figure{f: f, add: func(d float64) { f.adds += d }}
}
func (f *queueFigures) NewLatencyMetric(string) workqueue.HistogramMetric {
	return figure{f: f, observe: func(v float64) { f.waits = append(f.waits, v) }}
}
func (f *queueFigures) NewWorkDurationMetric(string) workqueue.HistogramMetric { return figure{f: f} }
func (f *queueFigures) NewUnfinishedWorkSecondsMetric(string) workqueue.SettableGaugeMetric {
	return figure{f: f}
}
func (f *queueFigures) NewLongestRunningProcessorSecondsMetric(string) workqueue.SettableGaugeMetric {
	return figure{f: f}
}
func (f *queueFigures) NewRetriesMetric(string) workqueue.CounterMetric { return figure{f: f} }

// figure is one metric of queueFigures; what it does not keep it ignores.
type figure struct {
	f       *queueFigures
	add     func(float64)
	observe func(float64)
}

func (m figure) change(d float64) {
	if m.add != nil {
		m.f.mu.Lock()
		m.add(d)
		m.f.mu.Unlock()
	}
}
func (m figure) Inc()        { m.change(1) }
func (m figure) Dec()        { m.change(-1) }
func (m figure) Set(float64) {}
func (m figure) Observe(v float64) {
	if m.observe != nil {
		m.f.mu.Lock()
		m.observe(v)
		m.f.mu.Unlock()
	}
}
