package lifecycle

import (
	"context"
	"sync"

	"k8s.io/client-go/util/workqueue"
)

// RunWorkers is the worker loop every sidecar shares: n workers take items from queue and
// call process until intake ends. Then the queue is shut down, items still queued are
// dropped (the next leader lists them again from its cache) and RunWorkers returns once
// every worker has finished the item it holds. process gets the item and should run its
// CSI call and status writes on env.Ops() (P1). An error requeues the item with rate
// limiting, unless intake has ended.
func RunWorkers[T comparable](intake context.Context, queue workqueue.TypedRateLimitingInterface[T], n int, process func(item T) error) {
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for processNext(intake, queue, process) {
			}
		})
	}
	<-intake.Done()
	queue.ShutDown()
	wg.Wait()
}

func processNext[T comparable](intake context.Context, queue workqueue.TypedRateLimitingInterface[T], process func(T) error) bool {
	item, shutdown := queue.Get()
	if shutdown {
		return false
	}
	defer queue.Done(item)
	if intake.Err() != nil {
		// Taken after the signal: not started here.
		return false
	}
	if err := process(item); err != nil {
		if intake.Err() == nil {
			queue.AddRateLimited(item)
		}
		return true
	}
	queue.Forget(item)
	return true
}
