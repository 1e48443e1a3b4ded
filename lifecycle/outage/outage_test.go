package outage

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
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
	c := New()
	// The retry's period is checked on the fake clock
	// (TestAListRetriesEveryHalfSecondThroughAnOutageAndAnswersWithinOneOnTheReturn); this
	// test checks the errors of a real socket, on the real clock.
	c.retry = 20 * time.Millisecond
	client := &http.Client{Transport: &outageTransport{next: &http.Transport{}, tracker: c}}
	get := func(ctx context.Context, query string) (*http.Response, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/api/v1/pods?"+query, nil)
		return client.Do(req)
	}
	watch, err := get(context.Background(), "watch=true&resourceVersion=1")
	if err != nil {
		t.Fatal(err)
	}
	if stale := c.Current(context.Background(), time.Minute); len(stale) != 0 {
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
	for c.Current(context.Background(), 0) == nil {
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
	if stale := c.Current(context.Background(), 0); len(stale) != 1 || stale[0] != "/api/v1/pods" {
		t.Fatalf("stale %v before the watch opened again, want /api/v1/pods", stale)
	}
	watched := make(chan []string, 1)
	go func() { watched <- c.Current(context.Background(), time.Minute) }()
	watch, err = get(context.Background(), "watch=true&resourceVersion=2")
	if err != nil {
		t.Fatal(err)
	}
	defer watch.Body.Close()
	if stale := <-watched; len(stale) != 0 {
		t.Errorf("stale %v once the watch opened again", stale)
	}
}

// P7 on the clock: while the API server cannot be reached a list retries every 500 ms (not
// client-go's backoff of up to a minute) and does not return, however long the outage;
// once the server is back it answers within one retry; a plain read is never held. The
// server is in memory, so that the outage's time is the fake clock's.
func TestAListRetriesEveryHalfSecondThroughAnOutageAndAnswersWithinOneOnTheReturn(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := &memoryServer{up: true}
		c := New()
		client := &http.Client{Transport: &outageTransport{next: srv, tracker: c}}
		// Ends a list still held when the test fails, so that the bubble ends.
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		get := func(query string) (*http.Response, error) {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://apiserver/api/v1/pods?"+query, nil)
			return client.Do(req)
		}
		watch, err := get("watch=true&resourceVersion=1")
		if err != nil {
			t.Fatal(err)
		}
		go io.Copy(io.Discard, watch.Body)
		srv.setUp(false)

		const list = "resourceVersion=0&limit=500"
		listed := make(chan error, 1)
		go func() {
			resp, err := get(list)
			if err == nil {
				resp.Body.Close()
			}
			listed <- err
		}()
		// P7 promises a retry every 500 ms; the end-to-end outage test's bound cannot tell
		// 500 ms from tens of seconds.
		const outage, retry = time.Minute, 500 * time.Millisecond
		time.Sleep(outage)
		synctest.Wait()
		select {
		case err := <-listed:
			t.Fatalf("the list returned (%v) while the server was away", err)
		default:
		}
		if got, want := srv.count(list), int(outage/retry)+1; got != want {
			t.Errorf("the list tried %d times in an outage of %v, want %d (every %v)", got, outage, want, retry)
		}
		if stale := c.Current(context.Background(), 0); len(stale) != 1 || stale[0] != "/api/v1/pods" {
			t.Errorf("stale %v during the outage, want /api/v1/pods", stale)
		}
		began := time.Now()
		if _, err := get(""); err == nil || time.Since(began) != 0 {
			t.Errorf("a GET by name with no server: %v after %v, want an error at once", err, time.Since(began))
		}

		srv.setUp(true)
		time.Sleep(retry)
		synctest.Wait()
		select {
		case err := <-listed:
			if err != nil {
				t.Fatalf("the list failed instead of waiting for the server: %v", err)
			}
		default:
			t.Fatalf("the list has not answered %v after the server came back", retry)
		}
		watch, err = get("watch=true&resourceVersion=2")
		if err != nil {
			t.Fatal(err)
		}
		if stale := c.Current(context.Background(), 0); len(stale) != 0 {
			t.Errorf("stale %v once the watch opened again", stale)
		}
		watch.Body.Close()
	})
}

// memoryServer is an API server in memory for the outage transport: while down, every
// request finds the connection refused and every open watch ends; while up, it answers 200,
// a watch with a stream that stays open.
type memoryServer struct {
	mu       sync.Mutex
	up       bool
	requests []string // the query of each request that tried to reach it
	watches  []*io.PipeWriter
}

func (s *memoryServer) RoundTrip(req *http.Request) (*http.Response, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.requests = append(s.requests, req.URL.RawQuery)
	if !s.up {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	}
	body := io.NopCloser(strings.NewReader("{}"))
	if isWatch(req) {
		r, w := io.Pipe()
		s.watches = append(s.watches, w)
		body = r
	}
	return &http.Response{StatusCode: http.StatusOK, Body: body, Request: req}, nil
}

func (s *memoryServer) setUp(up bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.up = up
	if !up {
		for _, w := range s.watches {
			w.CloseWithError(io.ErrUnexpectedEOF)
		}
		s.watches = nil
	}
}

func (s *memoryServer) count(query string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, q := range s.requests {
		if q == query {
			n++
		}
	}
	return n
}
