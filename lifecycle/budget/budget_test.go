package budget

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

// A budget with no tokens left serves every waiting request that finishes work before any
// request that starts work, and those before deferrable ones, whatever order they came in.
func TestBudgetServesFinishingWorkBeforeStartingWork(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := newBudget(5, 1) // one token, then one every 200 ms
		defer b.Stop()
		// The dispatcher starts once every request waits, so that none is served before
		// the last has come.
		b.mu.Lock()
		b.started = true
		b.mu.Unlock()
		var mu sync.Mutex
		var order []string
		var wg sync.WaitGroup
		for i, r := range []struct {
			name  string
			class func(ctx, intake context.Context) (context.Context, context.CancelFunc)
		}{{"later1", Deferrable}, {"start1", StartingWork}, {"start2", StartingWork}, {"finish1", nil}, {"later2", Deferrable}, {"finish2", nil}} {
			wg.Go(func() {
				ctx := context.Background()
				if r.class != nil {
					var cancel context.CancelFunc
					ctx, cancel = r.class(ctx, context.Background())
					defer cancel()
				}
				if err := b.Wait(ctx); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				order = append(order, r.name)
				mu.Unlock()
			})
			synctest.Wait()
			if n := waiters(b); n != i+1 {
				t.Fatalf("%d requests wait for a token, want %d", n, i+1)
			}
		}
		go b.dispatch()
		wg.Wait()
		want := []string{"finish1", "finish2", "start1", "start2", "later1", "later2"}
		if !slices.Equal(order, want) {
			t.Fatalf("served %v, want %v", order, want)
		}
	})
}

// waiters is how many requests wait for a token.
func waiters(b *Budget) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, q := range b.waiting {
		n += len(q)
	}
	return n
}

// A request that waits for its token is not abandoned for being throttled: it waits as long
// as its context lives, and gives up only when that ends.
func TestBudgetWaitEndsOnlyWithTheContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := newBudget(1, 1)
		defer b.Stop()
		if err := b.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error)
		go func() { errc <- b.Wait(ctx) }()
		cancel()
		if err := <-errc; err != context.Canceled {
			t.Errorf("cancelled wait: %v, want context.Canceled", err)
		}
		began := time.Now()
		if err := b.Wait(context.Background()); err != nil {
			t.Errorf("wait without deadline: %v", err)
		}
		if waited := time.Since(began); waited > time.Second {
			t.Errorf("wait without deadline took %v, want the next token's second at most", waited)
		}
	})
}

// A write that starts work ends with intake, so that it never stretches a drain.
func TestStartingWorkEndsWithIntake(t *testing.T) {
	intake, stop := context.WithCancel(context.Background())
	ctx, cancel := StartingWork(context.Background(), intake)
	defer cancel()
	if classOf(ctx) != classStarting {
		t.Error("not marked as starting work")
	}
	stop()
	select {
	case <-ctx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("still open after intake ended")
	}
	// A write waiting for its token when intake ended did not start its work.
	if err := newBudget(1, 1).Wait(ctx); !errors.Is(err, errIntakeEnded) || !EndedWithIntake(ctx) {
		t.Errorf("write cut short by intake's end: %v, want it ended with intake", err)
	}
	// Ended otherwise (its own cancel, while intake lasts), it did not end with intake.
	own, cancelOwn := StartingWork(context.Background(), context.Background())
	cancelOwn()
	if EndedWithIntake(own) {
		t.Error("a write cancelled while intake lasts ended with intake")
	}
}

func TestBudgetForFollowsClientGo(t *testing.T) {
	if For(-1, 10, nil) != nil {
		t.Error("a negative QPS has a budget; want no client-side limit")
	}
	if b := For(0, 0, nil); b.QPS() != 5 || b.limiter.Burst() != 10 {
		t.Errorf("QPS 0: %v/%d, want client-go's 5/10", b.QPS(), b.limiter.Burst())
	}
}

// A request that starts work does not take the token a write recording a call in flight
// will need: with one call in flight it waits until the bucket holds two tokens, and a
// finishing request that comes when it holds one is served first.
func TestBudgetKeepsATokenForEachCallInFlight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := newBudget(1, 2) // a token a second once the burst is spent
		defer b.Stop()
		b.owed = func() int { return 1 }
		for range 2 {
			if err := b.Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		began := time.Now()
		var mu sync.Mutex
		var order []string
		served := map[string]time.Duration{}
		var wg sync.WaitGroup
		serve := func(name string, ctx context.Context) {
			if err := b.Wait(ctx); err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			order = append(order, name)
			served[name] = time.Since(began)
			mu.Unlock()
		}
		start, cancel := StartingWork(context.Background(), context.Background())
		defer cancel()
		wg.Go(func() { serve("start", start) })
		// A second later the bucket holds one token: the one the call in flight is owed.
		time.Sleep(time.Second)
		synctest.Wait()
		mu.Lock()
		early := slices.Clone(order)
		mu.Unlock()
		if len(early) != 0 {
			t.Fatalf("served %v with one token in the bucket: the starting request took the token owed to a call in flight", early)
		}
		wg.Go(func() { serve("finish", context.Background()) })
		wg.Wait()
		if want := []string{"finish", "start"}; !slices.Equal(order, want) {
			t.Fatalf("served %v, want %v: the starting request took the token owed to a call in flight", order, want)
		}
		// The finishing request took the token at once; the starting one then waits for two.
		if served["finish"] != time.Second || served["start"] < 3*time.Second {
			t.Errorf("served finish after %v and start after %v, want 1s and at least 3s", served["finish"], served["start"])
		}
	})
}

// A stopped budget leaves no goroutine behind, whether its dispatcher was idle or busy
// handing out tokens, and a request waiting for a token then, or made later, fails.
func TestStoppedBudgetLeavesNoGoroutine(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	idle := newBudget(1, 1)
	if err := idle.Wait(context.Background()); err != nil { // starts its dispatcher
		t.Fatal(err)
	}
	idle.Stop()

	busy := newBudget(0.001, 1) // one token, the next in about 17 minutes
	if err := busy.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- busy.Wait(context.Background()) }()
	waitForWaiters(t, busy, 1)
	busy.Stop()
	select {
	case err := <-waited:
		if !errors.Is(err, errBudgetStopped) {
			t.Errorf("request waiting at the stop: %v, want %v", err, errBudgetStopped)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a request waiting for a token still waits after the stop")
	}
	if err := busy.Wait(context.Background()); !errors.Is(err, errBudgetStopped) {
		t.Errorf("request after the stop: %v, want %v", err, errBudgetStopped)
	}
}

// waitForWaiters waits, on the real clock, until n requests wait for a token.
func waitForWaiters(t *testing.T, b *Budget, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for waiters(b) != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests wait for a token, want %d", waiters(b), n)
		}
		time.Sleep(time.Millisecond)
	}
}
