package lifecycle

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/csi-sidecars/csi-sidecars/lifecycle/outage"
)

// P7, P11: a term that starts after an outage waits for its caches, but never past a lost
// Lease: an expiry while it waits fences the term before the sidecar runs; once every
// watch has opened again, the term leads; a watch that never opens again holds it one
// lease duration at most.
func TestANewTermWaitsForItsCachesButNotPastALostLease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const leaseDuration = 15 * time.Second
		c := outage.New()
		opened := time.Now()
		c.WatchOpened("/api/v1/pods", opened)
		c.SawUnreachable(opened.Add(time.Millisecond))
		p := &process{opts: &Options{LeaseDuration: leaseDuration, RenewDeadline: 10 * time.Second}, caches: c}
		m := &member{}
		returned := func(ch <-chan string) (string, bool) {
			synctest.Wait()
			select {
			case why := <-ch:
				return why, true
			default:
				return "", false
			}
		}

		expired := make(chan struct{})
		lost := make(chan string, 1)
		go func() {
			lost <- m.waitForCaches(context.Background(), p, term{leading: context.Background(), expired: expired})
		}()
		time.Sleep(time.Second)
		if why, ok := returned(lost); ok {
			t.Fatalf("the term went on (%q) with a watch not yet open again", why)
		}
		close(expired)
		if why, ok := returned(lost); !ok || why == "" {
			t.Fatalf("a term whose Lease expired while it waited for its caches: returned %v, why %q; want fenced at once", ok, why)
		}

		led := make(chan string, 1)
		go func() { led <- m.waitForCaches(context.Background(), p, term{leading: context.Background()}) }()
		time.Sleep(leaseDuration / 2)
		if why, ok := returned(led); ok {
			t.Fatalf("the term went on (%q) with a watch not yet open again", why)
		}
		c.WatchOpened("/api/v1/pods", time.Now())
		if why, ok := returned(led); !ok || why != "" {
			t.Fatalf("once its caches were current the term returned %v, why %q; want it to lead at once", ok, why)
		}

		// A watch that does not open again: the term leads one lease duration after it began.
		c.SawUnreachable(time.Now())
		bounded := make(chan string, 1)
		go func() { bounded <- m.waitForCaches(context.Background(), p, term{leading: context.Background()}) }()
		time.Sleep(leaseDuration - time.Nanosecond)
		if why, ok := returned(bounded); ok {
			t.Fatalf("the term went on (%q) before a lease duration with a watch not yet open again", why)
		}
		time.Sleep(time.Nanosecond)
		if why, ok := returned(bounded); !ok || why != "" {
			t.Fatalf("a lease duration after it began the term returned %v, why %q; want it to lead", ok, why)
		}
	})
}
