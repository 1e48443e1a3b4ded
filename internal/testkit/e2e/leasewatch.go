package e2e

import (
	"context"
	"fmt"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"
)

// LeaseChange is a change of a Lease's holder that a LeaseWatch saw: a new Lease, a new
// holder, a release (Holder "") or the Lease's deletion (Holder "", Deleted).
type LeaseChange struct {
	Lease   string
	Holder  string
	Deleted bool
	// At is when the watch delivered the change (the test's clock).
	At time.Time
	// Written is the record's renewTime: when its writer wrote it (a new holder's
	// acquisition, or a release), by the writer's clock; zero if the record has none.
	// On one machine it is the more precise of the two.
	Written time.Time
}

// LeaseWatch records every change of holder of the Leases of one namespace. It watches from
// the resourceVersion of a first list and resumes where it left off after a dropped
// connection, so no record written in between is missed: a release that a standby's
// takeover follows at once is seen as its own change. Its methods are safe for concurrent
// use.
type LeaseWatch struct {
	mu      sync.Mutex
	changes []LeaseChange
	holders map[string]string
	err     error
	done    chan struct{}
}

// WatchLeases starts recording the changes of holder of the scenario's Leases, beginning
// with their holders now; it stops at the end of the test.
func (s *Scenario) WatchLeases() *LeaseWatch {
	s.T.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	leases := s.Client.CoordinationV1().Leases(s.Namespace)
	list, err := leases.List(ctx, metav1.ListOptions{})
	if err != nil {
		cancel()
		s.T.Fatalf("listing the Leases of %s: %v", s.Namespace, err)
	}
	lw := &LeaseWatch{holders: map[string]string{}, done: make(chan struct{})}
	now := time.Now()
	for i := range list.Items {
		lw.observe(&list.Items[i], false, now)
	}
	rw, err := watchtools.NewRetryWatcherWithContext(ctx, list.ResourceVersion, &cache.ListWatch{
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return leases.Watch(ctx, o)
		},
	})
	if err != nil {
		cancel()
		s.T.Fatalf("watching the Leases of %s: %v", s.Namespace, err)
	}
	go lw.run(rw)
	s.T.Cleanup(func() {
		cancel()
		rw.Stop()
		<-lw.done
	})
	return lw
}

func (lw *LeaseWatch) run(rw *watchtools.RetryWatcher) {
	defer close(lw.done)
	for ev := range rw.ResultChan() {
		switch ev.Type {
		case watch.Added, watch.Modified, watch.Deleted:
			if l, ok := ev.Object.(*coordinationv1.Lease); ok {
				lw.observe(l, ev.Type == watch.Deleted, time.Now())
			}
		case watch.Error:
			lw.mu.Lock()
			lw.err = fmt.Errorf("e2e: watching Leases: %w", apierrors.FromObject(ev.Object))
			lw.mu.Unlock()
			return
		}
	}
}

func (lw *LeaseWatch) observe(l *coordinationv1.Lease, deleted bool, at time.Time) {
	holder := Holder(l)
	if deleted {
		holder = ""
	}
	lw.mu.Lock()
	defer lw.mu.Unlock()
	if prev, seen := lw.holders[l.Name]; seen && prev == holder && !deleted {
		return // a renewal
	}
	lw.holders[l.Name] = holder
	c := LeaseChange{Lease: l.Name, Holder: holder, Deleted: deleted, At: at}
	if l.Spec.RenewTime != nil {
		c.Written = l.Spec.RenewTime.Time
	}
	lw.changes = append(lw.changes, c)
}

// Changes are the changes of holder of Lease name so far (of every Lease when name is
// ""), in the order they were seen.
func (lw *LeaseWatch) Changes(name string) []LeaseChange {
	lw.mu.Lock()
	defer lw.mu.Unlock()
	var out []LeaseChange
	for _, c := range lw.changes {
		if name == "" || c.Lease == name {
			out = append(out, c)
		}
	}
	return out
}

// HolderAt is who held Lease name at t as far as the watch had seen by then, "" for nobody.
func (lw *LeaseWatch) HolderAt(name string, t time.Time) string {
	holder := ""
	for _, c := range lw.Changes(name) {
		if c.At.After(t) {
			break
		}
		holder = c.Holder
	}
	return holder
}

// Err is why the watch ended early (for example, the API server compacted past it), nil
// while it runs or after it was stopped.
func (lw *LeaseWatch) Err() error {
	lw.mu.Lock()
	defer lw.mu.Unlock()
	return lw.err
}
