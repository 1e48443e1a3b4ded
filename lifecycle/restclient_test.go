package lifecycle

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	k8smetrics "k8s.io/component-base/metrics"
)

// A sidecar's clients report client-go's REST client metrics under its name: every
// request by code, method and host, its latency, and its wait for the sidecar's budget,
// which still paces the requests and still tells client-go its QPS.
func TestRESTClientMetricsArePerSidecarAndTheBudgetStillPaces(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/missing") {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			_, _ = w.Write([]byte(`{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}`))
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"kind":"Namespace","apiVersion":"v1","metadata":{"name":"x"}}`))
	}))
	defer srv.Close()
	reg := k8smetrics.NewKubeRegistry()
	m := newRestMetrics(reg)
	b := newBudget(5, 1) // one token, then one every 200 ms
	kube, err := kubernetes.NewForConfig(m.client(&rest.Config{Host: srv.URL}, "attacher", b))
	if err != nil {
		t.Fatal(err)
	}
	other, err := kubernetes.NewForConfig(m.client(&rest.Config{Host: srv.URL}, "resizer", nil))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// The first request finds the budget's dispatcher not started: it waits in the
	// transport until the dispatcher starts, 300 ms after the request began to wait.
	b.mu.Lock()
	b.started = true
	b.mu.Unlock()
	first := make(chan error, 1)
	go func() {
		_, err := kube.CoreV1().Namespaces().Get(ctx, "x", metav1.GetOptions{})
		first <- err
	}()
	for waiting, start := 0, time.Now(); waiting == 0; {
		if time.Since(start) > time.Minute {
			t.Fatal("the first request never waited for the budget")
		}
		time.Sleep(time.Millisecond)
		b.mu.Lock()
		waiting = len(b.waiting[classFinishing])
		b.mu.Unlock()
	}
	time.Sleep(300 * time.Millisecond)
	go b.dispatch()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"x", "missing"} {
		_, _ = kube.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
	}
	if _, err := other.CoreV1().Namespaces().Get(ctx, "x", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := kube.CoreV1().RESTClient().GetRateLimiter().QPS(); got != 5 {
		t.Errorf("the client's rate limiter reports QPS %v, want the budget's 5", got)
	}

	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := func(name string, labels map[string]string) []*dto.Metric {
		var out []*dto.Metric
		for _, f := range families {
			if f.GetName() != name {
				continue
			}
		metrics:
			for _, s := range f.GetMetric() {
				have := map[string]string{}
				for _, l := range s.GetLabel() {
					have[l.GetName()] = l.GetValue()
				}
				for k, v := range labels {
					if have[k] != v {
						continue metrics
					}
				}
				out = append(out, s)
			}
		}
		return out
	}
	host := strings.TrimPrefix(srv.URL, "http://")
	for _, c := range []struct {
		labels map[string]string
		want   float64
	}{
		{map[string]string{"sidecar": "attacher", "code": "200", "method": "GET", "host": host}, 2},
		{map[string]string{"sidecar": "attacher", "code": "404", "method": "GET", "host": host}, 1},
		{map[string]string{"sidecar": "resizer", "code": "200", "method": "GET", "host": host}, 1},
	} {
		s := series("rest_client_requests_total", c.labels)
		if len(s) != 1 || s[0].GetCounter().GetValue() != c.want {
			t.Errorf("rest_client_requests_total%v: %v, want %v", c.labels, s, c.want)
		}
	}
	if s := series("rest_client_request_duration_seconds", map[string]string{"sidecar": "attacher", "verb": "GET", "host": host}); len(s) != 1 || s[0].GetHistogram().GetSampleCount() != 3 {
		t.Errorf("rest_client_request_duration_seconds of attacher: %v, want 3 samples", s)
	}
	limiter := series("rest_client_rate_limiter_duration_seconds", map[string]string{"sidecar": "attacher", "verb": "GET", "host": host})
	if len(limiter) != 1 || limiter[0].GetHistogram().GetSampleCount() != 3 {
		t.Fatalf("rest_client_rate_limiter_duration_seconds of attacher: %v, want 3 samples", limiter)
	}
	if sum := limiter[0].GetHistogram().GetSampleSum(); sum < 0.3 {
		t.Errorf("the attacher's requests waited %.3fs for its budget in all; the first alone waited 0.3s at least", sum)
	}
	if s := series("rest_client_rate_limiter_duration_seconds", map[string]string{"sidecar": "resizer"}); len(s) != 0 {
		t.Errorf("a client without a budget reports rate-limiter waits: %v", s)
	}
}

// P1, P14 through a real client: the budget now waits in the transport, and a request
// that would start work (StartingWork) still waits there behind its class, ends when
// intake ends, is never sent, and is recognised as not started.
func TestAStartingRequestWaitingInTheTransportEndsWithIntake(t *testing.T) {
	var sent atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sent.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"kind":"Namespace","apiVersion":"v1","metadata":{"name":"x"}}`))
	}))
	defer srv.Close()
	b := newBudget(5, 1)
	// No dispatcher: every request waits for a token until its context ends.
	b.mu.Lock()
	b.started = true
	b.mu.Unlock()
	kube, err := kubernetes.NewForConfig(newRestMetrics(k8smetrics.NewKubeRegistry()).client(&rest.Config{Host: srv.URL}, "provisioner", b))
	if err != nil {
		t.Fatal(err)
	}
	intake, endIntake := context.WithCancel(context.Background())
	ctx, cancel := StartingWork(context.Background(), intake)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := kube.CoreV1().Namespaces().Get(ctx, "x", metav1.GetOptions{})
		done <- err
	}()
	for waiting, start := 0, time.Now(); waiting == 0; {
		if time.Since(start) > time.Minute {
			t.Fatal("the request never waited for the budget as one that starts work")
		}
		time.Sleep(time.Millisecond)
		b.mu.Lock()
		waiting = len(b.waiting[classStarting])
		b.mu.Unlock()
	}
	endIntake()
	select {
	case err = <-done:
	case <-time.After(time.Minute):
		t.Fatal("the request still waits for a token a minute after intake ended")
	}
	if err == nil || !NotStarted(IfNotStarted(ctx, err)) {
		t.Errorf("the request ended with %v; want an error IfNotStarted recognises as not started", err)
	}
	if n := sent.Load(); n != 0 {
		t.Errorf("the server received %d requests; a request whose intake ended waiting must not be sent", n)
	}
}
