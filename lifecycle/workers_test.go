package lifecycle

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/client-go/util/workqueue"
)

func TestQueuedItemsAreDroppedWhenIntakeEnds(t *testing.T) {
	queue := workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[int]())
	for i := range 5 {
		queue.Add(i)
	}
	intake, stop := context.WithCancel(context.Background())
	holding := make(chan int)
	release := make(chan struct{})
	var mu sync.Mutex
	var processed []int
	done := make(chan struct{})
	go func() {
		defer close(done)
		RunWorkers(intake, queue, 1, func(item int) error {
			mu.Lock()
			processed = append(processed, item)
			mu.Unlock()
			holding <- item
			<-release
			return nil
		})
	}()
	first := <-holding
	stop()
	close(release)
	<-done
	if len(processed) != 1 || processed[0] != first {
		t.Errorf("processed %v after intake ended; want only the item held at the signal (%d)", processed, first)
	}
}

// blockingConn stands in for a driver that works until its caller gives up.
type blockingConn struct{ calls atomic.Int64 }

func (c *blockingConn) Invoke(ctx context.Context, _ string, _, _ any, _ ...grpc.CallOption) error {
	c.calls.Add(1)
	<-ctx.Done()
	return status.FromContextError(ctx.Err()).Err()
}

func (c *blockingConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	return nil, nil
}

func TestFencingCancelsCallsWhateverTheirContext(t *testing.T) {
	ops, cancelOps := context.WithCancel(context.Background())
	inner := &blockingConn{}
	var gauge int64
	var mu sync.Mutex
	conn := &fencedConn{conn: inner, ops: ops, calls: callCount{onChange: func(d int64) { mu.Lock(); gauge += d; mu.Unlock() }}}

	errc := make(chan error)
	go func() {
		errc <- conn.Invoke(context.Background(), "/csi.v1.Controller/ControllerPublishVolume", nil, nil)
	}()
	for inner.calls.Load() != 1 {
		runtime.Gosched() // wait until the call reached the driver
	}
	cancelOps()
	if err := <-errc; status.Code(err) != codes.Canceled {
		t.Errorf("in-flight call after fencing: %v, want Canceled", err)
	}
	if err := conn.Invoke(context.Background(), "/csi.v1.Controller/ControllerPublishVolume", nil, nil); status.Code(err) != codes.Aborted {
		t.Errorf("new call after fencing: %v, want Aborted", err)
	}
	if inner.calls.Load() != 1 || conn.InFlight() != 0 || gauge != 0 {
		t.Errorf("driver saw %d calls, in flight %d, gauge %d; want 1, 0, 0", inner.calls.Load(), conn.InFlight(), gauge)
	}
}

func TestDrainingRefusesNewCallsAndLetsRunningOnesEnd(t *testing.T) {
	ops, cancelOps := context.WithCancel(context.Background())
	defer cancelOps()
	inner := &blockingConn{}
	conn := &fencedConn{conn: inner, ops: ops}
	callCtx, endCall := context.WithCancel(context.Background())
	errc := make(chan error)
	go func() {
		errc <- conn.Invoke(callCtx, "/csi.v1.Controller/CreateVolume", nil, nil)
	}()
	for inner.calls.Load() != 1 {
		runtime.Gosched()
	}
	conn.drain()
	if err := conn.Invoke(context.Background(), "/csi.v1.Controller/CreateVolume", nil, nil); status.Code(err) != codes.Aborted || !NotStarted(err) {
		t.Errorf("new call while draining: %v, want Aborted, NotStarted", err)
	}
	if conn.idleAfterDrain() {
		t.Error("idle while a call runs in the driver")
	}
	endCall()
	if err := <-errc; status.Code(err) != codes.Canceled {
		t.Errorf("running call: %v, want it to end on its own context (Canceled)", err)
	}
	if !conn.idleAfterDrain() || inner.calls.Load() != 1 {
		t.Errorf("idle %v, driver saw %d calls; want idle after the one call", conn.idleAfterDrain(), inner.calls.Load())
	}
}
