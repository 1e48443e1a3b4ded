package lifecycle

import (
	"slices"
	"sync"
	"time"

	"k8s.io/client-go/util/workqueue"
	"k8s.io/component-base/metrics"
)

// QueueOptions configure NewQueue.
type QueueOptions struct {
	// Name is the queue's name in client-go's workqueue metrics (upstream's names, P9).
	Name string
	// RetryStart and RetryMax bound the per-item exponential backoff of failed items
	// (--retry-interval-start, --retry-interval-max).
	RetryStart, RetryMax time.Duration
	// Metrics is where client-go's workqueue metrics go; nil is its process-wide provider.
	Metrics workqueue.MetricsProvider
	// Backlog, when set, reports the queue's backlog (Env.Backlog), and keeps what is added
	// while the sidecar stands by out of the workqueue until it leads.
	Backlog *Backlog
}

// Queue is a sidecar's rate-limited work queue that knows its backlog: how many items wait
// for a worker and since when the oldest waits. It is the one way sidecars build queues.
//
// While the sidecar stands by, its handlers fill the queue so that it starts warm (P7), but
// nobody waits for that work yet: the items are held beside the workqueue and enter it when
// the sidecar leads. So client-go's queue metrics (workqueue_depth, adds, queue durations)
// and the backlog describe the leader's work only: a healthy standby's stay at zero however
// long it stands by, and a new leader's waits count from its takeover. Get blocks until then.
type Queue[T comparable] struct {
	workqueue.TypedRateLimitingInterface[T]
	name    string
	limiter workqueue.TypedRateLimiter[T]

	mu sync.Mutex
	// waiting holds, per item not yet taken by a worker, when it became ready (for an item
	// added with a delay: when the delay ends).
	waiting map[T]time.Time
	// held holds, while the sidecar stands by, each item added and when it becomes ready;
	// nil once it leads (or when the queue has no Backlog).
	held map[T]time.Time
}

// NewQueue builds a rate-limited queue with exponential per-item backoff.
func NewQueue[T comparable](o QueueOptions) *Queue[T] {
	limiter := workqueue.NewTypedItemExponentialFailureRateLimiter[T](o.RetryStart, o.RetryMax)
	q := &Queue[T]{
		TypedRateLimitingInterface: workqueue.NewTypedRateLimitingQueueWithConfig(limiter,
			workqueue.TypedRateLimitingQueueConfig[T]{Name: o.Name, MetricsProvider: o.Metrics}),
		name:    o.Name,
		limiter: limiter,
		waiting: map[T]time.Time{},
	}
	if o.Backlog != nil {
		o.Backlog.add(q)
	}
	return q
}

func (q *Queue[T]) note(item T, ready time.Time) {
	if q.ShuttingDown() {
		return // the workqueue drops the item
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if at, ok := q.waiting[item]; !ok || ready.Before(at) {
		q.waiting[item] = ready
	}
}

// hold keeps item out of the workqueue while the sidecar stands by; false once it leads.
func (q *Queue[T]) hold(item T, ready time.Time) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.held == nil {
		return false
	}
	if at, ok := q.held[item]; !ok || ready.Before(at) {
		q.held[item] = ready
	}
	return true
}

// standBy starts holding what is added (Backlog.add, before the queue is used).
func (q *Queue[T]) standBy() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.held = map[T]time.Time{}
}

// lead moves what was held into the workqueue, as if added at now: an item due by then is
// queued at once, one added with a longer delay when that delay ends.
func (q *Queue[T]) lead(now time.Time) {
	q.mu.Lock()
	held := q.held
	q.held = nil
	q.mu.Unlock()
	for item, ready := range held {
		if d := ready.Sub(now); d > 0 {
			q.AddAfter(item, d)
		} else {
			q.Add(item)
		}
	}
}

// Add implements workqueue.Interface.
func (q *Queue[T]) Add(item T) {
	now := time.Now()
	if q.hold(item, now) {
		return
	}
	q.note(item, now)
	q.TypedRateLimitingInterface.Add(item)
}

// AddAfter implements workqueue.DelayingInterface.
func (q *Queue[T]) AddAfter(item T, d time.Duration) {
	ready := time.Now().Add(d)
	if q.hold(item, ready) {
		return
	}
	q.note(item, ready)
	q.TypedRateLimitingInterface.AddAfter(item, d)
}

// AddRateLimited implements workqueue.RateLimitingInterface: the item's next backoff.
func (q *Queue[T]) AddRateLimited(item T) {
	q.AddAfter(item, q.limiter.When(item))
}

// Get implements workqueue.Interface: the item no longer waits.
func (q *Queue[T]) Get() (T, bool) {
	item, shutdown := q.TypedRateLimitingInterface.Get()
	q.mu.Lock()
	delete(q.waiting, item)
	q.mu.Unlock()
	return item, shutdown
}

// ShutDown implements workqueue.Interface. Nothing counts as waiting from then on: new
// items are dropped, and the workers stop taking queued ones (RunWorkers, P1).
func (q *Queue[T]) ShutDown() {
	q.TypedRateLimitingInterface.ShutDown()
	q.mu.Lock()
	clear(q.waiting)
	q.held = nil
	q.mu.Unlock()
}

// backlog counts the items ready and waiting for a worker at now and the age of the oldest.
func (q *Queue[T]) backlog(now time.Time) (waiting int, oldest time.Duration) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, ready := range q.waiting {
		if ready.After(now) {
			continue
		}
		waiting++
		oldest = max(oldest, now.Sub(ready))
	}
	return waiting, oldest
}

// Backlog is what one sidecar's queues have waiting, for /metrics and the backlog log line.
// It also tells them when the sidecar leads. The zero value's queues work at once, as a
// sidecar's unit tests want; the core's hold their items until the sidecar leads.
type Backlog struct {
	sidecar string
	mu      sync.Mutex
	queues  []backlogSource
	// standby: the sidecar does not lead yet; its queues hold what is added.
	standby bool
}

type backlogSource interface {
	queueName() string
	backlog(now time.Time) (int, time.Duration)
	standBy()
	lead(now time.Time)
}

func (q *Queue[T]) queueName() string { return q.name }

func (b *Backlog) add(q backlogSource) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.queues = append(b.queues, q)
	if b.standby {
		q.standBy()
	}
}

// lead tells the sidecar's queues that it leads from now on: what they held enters them.
func (b *Backlog) lead() {
	b.mu.Lock()
	b.standby = false
	queues := slices.Clone(b.queues)
	b.mu.Unlock()
	now := time.Now()
	for _, q := range queues {
		q.lead(now)
	}
}

// QueueBacklog is one queue's backlog.
type QueueBacklog struct {
	Queue   string
	Waiting int
	Oldest  time.Duration
}

// Now reports every queue's backlog at now.
func (b *Backlog) Now(now time.Time) []QueueBacklog {
	b.mu.Lock()
	queues := append([]backlogSource(nil), b.queues...)
	b.mu.Unlock()
	out := make([]QueueBacklog, 0, len(queues))
	for _, q := range queues {
		n, oldest := q.backlog(now)
		out = append(out, QueueBacklog{Queue: q.queueName(), Waiting: n, Oldest: oldest})
	}
	return out
}

// backlogCollector exports the backlogs of every hosted sidecar, computed at each scrape.
type backlogCollector struct {
	metrics.BaseStableCollector
	backlogs func() []*Backlog
	items    *metrics.Desc
	age      *metrics.Desc
}

func newBacklogCollector(backlogs func() []*Backlog) *backlogCollector {
	return &backlogCollector{
		backlogs: backlogs,
		items: metrics.NewDesc("csi_sidecars_queue_waiting_items",
			"Items ready in a sidecar's queue and waiting for a worker.", []string{"sidecar", "queue"}, nil, metrics.ALPHA, ""),
		age: metrics.NewDesc("csi_sidecars_queue_oldest_waiting_seconds",
			"How long the oldest item ready in a sidecar's queue has waited for a worker (0 when none waits).", []string{"sidecar", "queue"}, nil, metrics.ALPHA, ""),
	}
}

func (c *backlogCollector) DescribeWithStability(ch chan<- *metrics.Desc) {
	ch <- c.items
	ch <- c.age
}

func (c *backlogCollector) CollectWithStability(ch chan<- metrics.Metric) {
	now := time.Now()
	for _, b := range c.backlogs() {
		for _, q := range b.Now(now) {
			ch <- metrics.NewLazyConstMetric(c.items, metrics.GaugeValue, float64(q.Waiting), b.sidecar, q.Queue)
			ch <- metrics.NewLazyConstMetric(c.age, metrics.GaugeValue, q.Oldest.Seconds(), b.sidecar, q.Queue)
		}
	}
}
