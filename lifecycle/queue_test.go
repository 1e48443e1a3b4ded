package lifecycle

import (
	"testing"
	"time"
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
