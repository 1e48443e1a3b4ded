// Package outage keeps a leading sidecar's informers current through API server outages:
// its lists and watches wait for the server instead of backing off, and a replica that
// takes a Lease after an outage can wait until every watch has opened again (Current).
package outage

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sort"
	"sync"
	"syscall"
	"time"

	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
)

// outageRetry is how often a list or watch retries an API server it cannot reach.
const outageRetry = 500 * time.Millisecond

// Tracker keeps the process's informers current through API server outages (P7).
//
// client-go's reflectors back off exponentially, up to about a minute, while the API
// server cannot be reached, so after an outage a cache can stay stale for most of a minute
// after the server is back. Tracker wraps the transport of every client instead: a list or
// a watch that cannot reach the server retries the connection every outageRetry for as
// long as its context allows, so the reflector never sees the failure and never backs
// off. Its watch resumes from the last version it saw within outageRetry of the server's
// return, or, when the server no longer has that version, the reflector relists once. A
// request that cannot reach a server sends nothing, so the retries cost the API server
// nothing and spend none of the client's QPS.
//
// It also tracks the watches, so that a replica taking a Lease after an outage waits until
// every watch that ran before it is open again (the cache is then as current as the
// server, or its relist is done) before it acts on the caches: Current.
type Tracker struct {
	retry time.Duration

	mu sync.Mutex
	// unreachable is the last time a list or watch could not reach the API server.
	unreachable time.Time
	// watches holds, for each watched collection (path and selectors), when its current
	// watch opened: zero while none is open.
	watches map[string]time.Time
	changed chan struct{}
}

// New is a Tracker that has seen no outage and no watch.
func New() *Tracker {
	return &Tracker{retry: outageRetry, watches: map[string]time.Time{}, changed: make(chan struct{})}
}

// Wrap makes cfg's clients wait out outages in their lists and watches; every client
// built from a copy of cfg does.
func (c *Tracker) Wrap(cfg *rest.Config) {
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return &outageTransport{next: rt, tracker: c} })
}

// Current waits until every watch that was open before the last outage has opened again,
// or until ctx ends or bound passes. It returns the collections not yet watched again
// (none when the caches are current).
func (c *Tracker) Current(ctx context.Context, bound time.Duration) []string {
	timer := time.NewTimer(bound)
	defer timer.Stop()
	for {
		c.mu.Lock()
		stale := c.staleLocked()
		changed := c.changed
		c.mu.Unlock()
		if len(stale) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return stale
		case <-timer.C:
			return stale
		case <-changed:
		}
	}
}

func (c *Tracker) staleLocked() []string {
	if c.unreachable.IsZero() {
		return nil
	}
	var stale []string
	for key, opened := range c.watches {
		if !opened.After(c.unreachable) {
			stale = append(stale, key)
		}
	}
	sort.Strings(stale)
	return stale
}

func (c *Tracker) update(f func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	f()
	close(c.changed)
	c.changed = make(chan struct{})
}

// SawUnreachable records that a list or watch could not reach the API server at now: every
// watch opened before is stale until it opens again.
func (c *Tracker) SawUnreachable(now time.Time) {
	c.update(func() { c.unreachable = now })
}

// WatchOpened records that the watch of a collection (its path and selectors) opened at now.
func (c *Tracker) WatchOpened(key string, now time.Time) {
	c.update(func() { c.watches[key] = now })
}

func (c *Tracker) watchClosed(key string, opened time.Time) {
	c.update(func() {
		// A newer watch of the same collection may have opened meanwhile.
		if c.watches[key].Equal(opened) {
			c.watches[key] = time.Time{}
		}
	})
}

// outageTransport is the transport wrapper of a Tracker.
type outageTransport struct {
	next    http.RoundTripper
	tracker *Tracker
}

func (t *outageTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	watching := isWatch(req)
	if !watching && !isList(req) {
		return t.next.RoundTrip(req)
	}
	logged := false
	for {
		resp, err := t.next.RoundTrip(req)
		if err == nil || !unreachable(err) || req.Context().Err() != nil {
			if err == nil && watching && resp.StatusCode == http.StatusOK {
				resp.Body = t.track(req, resp.Body)
			}
			return resp, err
		}
		t.tracker.SawUnreachable(time.Now())
		if !logged {
			klog.FromContext(req.Context()).V(2).Info("API server unreachable; the list or watch retries until it answers", "path", req.URL.Path, "retry", t.tracker.retry, "err", err.Error())
			logged = true
		}
		timer := time.NewTimer(t.tracker.retry)
		select {
		case <-req.Context().Done():
			timer.Stop()
			return nil, err
		case <-timer.C:
		}
	}
}

// track records a watch as open until its stream ends.
func (t *outageTransport) track(req *http.Request, body io.ReadCloser) io.ReadCloser {
	q := req.URL.Query()
	key := req.URL.Path
	for _, sel := range []string{"labelSelector", "fieldSelector"} {
		if v := q.Get(sel); v != "" {
			key += "?" + sel + "=" + v
		}
	}
	opened := time.Now()
	t.tracker.WatchOpened(key, opened)
	return &watchBody{ReadCloser: body, end: func() { t.tracker.watchClosed(key, opened) }}
}

// watchBody calls end once, when the watch stream fails or is closed.
type watchBody struct {
	io.ReadCloser
	once sync.Once
	end  func()
}

func (b *watchBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.once.Do(b.end)
	}
	return n, err
}

func (b *watchBody) Close() error {
	b.once.Do(b.end)
	return b.ReadCloser.Close()
}

// isWatch tells a watch request.
func isWatch(req *http.Request) bool {
	return req.Method == http.MethodGet && req.URL.Query().Get("watch") == "true"
}

// isList tells a list request, as informers send them: a GET of a collection always
// carries a resourceVersion or a limit (a GET of one object by name carries neither), and
// a caller's list by selector carries the selector.
func isList(req *http.Request) bool {
	if req.Method != http.MethodGet {
		return false
	}
	q := req.URL.Query()
	for _, p := range []string{"resourceVersion", "limit", "labelSelector", "fieldSelector", "continue"} {
		if q.Has(p) {
			return true
		}
	}
	return false
}

// unreachable tells an error that says the API server could not be reached (nothing was
// served): a refused or reset connection, or one that the server closed.
func unreachable(err error) bool {
	var op *net.OpError
	switch {
	case utilnet.IsConnectionRefused(err), utilnet.IsConnectionReset(err), errors.Is(err, syscall.EHOSTUNREACH),
		errors.Is(err, syscall.ENETUNREACH), utilnet.IsProbableEOF(err):
		return true
	case errors.As(err, &op) && op.Op == "dial":
		return true
	}
	return false
}
