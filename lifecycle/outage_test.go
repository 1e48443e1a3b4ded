package lifecycle

import (
	"context"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// A list that finds the API server gone waits for it instead of failing (so client-go's
// reflector never backs off), answers as soon as the server is back, and marks the caches
// stale until every watch that was open has opened again.
func TestListsAndWatchesWaitOutAnOutageAndTheCachesKnowWhenTheyAreCurrent(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	mux := http.NewServeMux()
	mux.HandleFunc("/api/v1/pods", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		if r.URL.Query().Get("watch") == "true" {
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		}
	})
	serve := func(l net.Listener) *http.Server {
		srv := &http.Server{Handler: mux}
		go srv.Serve(l)
		return srv
	}
	srv := serve(l)
	c := newCaches()
	// P7 promises a retry every 500 ms (client-go's reflector backs off up to about a
	// minute); the end-to-end outage test's bound cannot tell 500 ms from tens of seconds.
	if c.retry != 500*time.Millisecond {
		t.Errorf("the caches retry an unreachable API server every %v, want 500ms", c.retry)
	}
	c.retry = 20 * time.Millisecond // the test's own, to run fast
	client := &http.Client{Transport: &outageTransport{next: &http.Transport{}, caches: c}}
	get := func(ctx context.Context, query string) (*http.Response, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/api/v1/pods?"+query, nil)
		return client.Do(req)
	}
	watch, err := get(context.Background(), "watch=true&resourceVersion=1")
	if err != nil {
		t.Fatal(err)
	}
	if stale := c.current(context.Background(), time.Minute); len(stale) != 0 {
		t.Fatalf("stale %v before any outage", stale)
	}

	// The server goes away: the watch ends, and a list waits.
	srv.Close()
	io.Copy(io.Discard, watch.Body)
	watch.Body.Close()
	listed := make(chan error, 1)
	go func() {
		resp, err := get(context.Background(), "resourceVersion=0&limit=500")
		if err == nil {
			resp.Body.Close()
		}
		listed <- err
	}()
	// A plain read is not held: it fails as it would without the wrapper.
	if _, err := get(context.Background(), ""); err == nil {
		t.Fatal("a GET by name succeeded with no server")
	}
	deadline, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := get(deadline, "watch=true"); err == nil {
		t.Fatal("a watch succeeded with no server")
	}
	for c.current(context.Background(), 0) == nil {
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case err := <-listed:
		t.Fatalf("the list returned while the server was away: %v", err)
	default:
	}

	// The server comes back on the same address.
	l, err = net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("the port was taken meanwhile: %v", err)
	}
	srv = serve(l)
	defer srv.Close()
	if err := <-listed; err != nil {
		t.Fatalf("the list failed instead of waiting for the server: %v", err)
	}
	if stale := c.current(context.Background(), 0); len(stale) != 1 || stale[0] != "/api/v1/pods" {
		t.Fatalf("stale %v before the watch opened again, want /api/v1/pods", stale)
	}
	watched := make(chan []string, 1)
	go func() { watched <- c.current(context.Background(), time.Minute) }()
	watch, err = get(context.Background(), "watch=true&resourceVersion=2")
	if err != nil {
		t.Fatal(err)
	}
	defer watch.Body.Close()
	if stale := <-watched; len(stale) != 0 {
		t.Errorf("stale %v once the watch opened again", stale)
	}
}

// P7, P11: a term that starts after an outage waits for its caches, but never past a lost
// Lease: an expiry while it waits fences the term before the sidecar runs; once every
// watch has opened again, the term leads.
func TestANewTermWaitsForItsCachesButNotPastALostLease(t *testing.T) {
	c := newCaches()
	opened := time.Now()
	c.watchOpened("/api/v1/pods", opened)
	c.sawUnreachable(opened.Add(time.Millisecond))
	p := &process{opts: &Options{LeaseDuration: time.Hour, RenewDeadline: 10 * time.Second}, caches: c}
	m := &member{}

	expired := make(chan struct{})
	lost := make(chan string, 1)
	go func() {
		lost <- m.waitForCaches(context.Background(), p, term{leading: context.Background(), expired: expired})
	}()
	close(expired)
	if why := <-lost; why == "" {
		t.Fatal("a term whose Lease expired while it waited for its caches went on to lead")
	}

	led := make(chan string, 1)
	go func() { led <- m.waitForCaches(context.Background(), p, term{leading: context.Background()}) }()
	select {
	case why := <-led:
		t.Fatalf("the term went on (%q) with a watch not yet open again", why)
	default:
	}
	c.watchOpened("/api/v1/pods", opened.Add(time.Second))
	if why := <-led; why != "" {
		t.Fatalf("the term was fenced (%s) once its caches were current", why)
	}
}
