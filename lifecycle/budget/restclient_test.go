package budget

import (
	"context"
	"io"
	"math"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
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
	synctest.Test(t, func(t *testing.T) {
		srv := namespaceServer(func(r *http.Request) {})
		reg := k8smetrics.NewKubeRegistry()
		m := NewRESTMetrics(reg)
		b := newBudget(5, 1) // one token, then one every 200 ms
		defer b.Stop()
		kube, err := kubernetes.NewForConfig(m.Client(&rest.Config{Host: apiHost, Transport: srv}, "attacher", b))
		if err != nil {
			t.Fatal(err)
		}
		other, err := kubernetes.NewForConfig(m.Client(&rest.Config{Host: apiHost, Transport: srv}, "resizer", nil))
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
		synctest.Wait()
		b.mu.Lock()
		waiting := len(b.waiting[classFinishing])
		b.mu.Unlock()
		if waiting != 1 {
			t.Fatalf("%d requests wait for the budget, want the first", waiting)
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
		host := strings.TrimPrefix(apiHost, "http://")
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
		// 300 ms for the dispatcher, then a token every 200 ms for the other two.
		if sum := limiter[0].GetHistogram().GetSampleSum(); math.Abs(sum-0.7) > 1e-9 {
			t.Errorf("the attacher's requests waited %.3fs for its budget in all, want 0.7s", sum)
		}
		if s := series("rest_client_rate_limiter_duration_seconds", map[string]string{"sidecar": "resizer"}); len(s) != 0 {
			t.Errorf("a client without a budget reports rate-limiter waits: %v", s)
		}
	})
}

// P1, P14 through a real client: the budget now waits in the transport, and a request
// that would start work (StartingWork) still waits there behind its class, ends when
// intake ends, is never sent, and is recognised as not started.
func TestAStartingRequestWaitingInTheTransportEndsWithIntake(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var sent atomic.Int32
		srv := namespaceServer(func(*http.Request) { sent.Add(1) })
		b := newBudget(5, 1)
		defer b.Stop()
		// No dispatcher: every request waits for a token until its context ends.
		b.mu.Lock()
		b.started = true
		b.mu.Unlock()
		kube, err := kubernetes.NewForConfig(NewRESTMetrics(k8smetrics.NewKubeRegistry()).Client(&rest.Config{Host: apiHost, Transport: srv}, "provisioner", b))
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
		synctest.Wait()
		b.mu.Lock()
		waiting := len(b.waiting[classStarting])
		b.mu.Unlock()
		if waiting != 1 {
			t.Fatalf("%d requests wait for the budget as ones that start work, want 1", waiting)
		}
		endIntake()
		synctest.Wait()
		select {
		case err = <-done:
		default:
			t.Fatal("the request still waits for a token after intake ended")
		}
		if err == nil || !EndedWithIntake(ctx) {
			t.Errorf("the request ended with %v; want an error of a context that ended with intake", err)
		}
		if n := sent.Load(); n != 0 {
			t.Errorf("the server received %d requests; a request whose intake ended waiting must not be sent", n)
		}
	})
}

// apiHost is the address of namespaceServer.
const apiHost = "http://apiserver"

// namespaceServer is an API server in memory that knows one namespace, x, and calls seen
// with each request it receives.
func namespaceServer(seen func(*http.Request)) http.RoundTripper {
	return roundTripperFunc(func(r *http.Request) (*http.Response, error) {
		seen(r)
		code, body := http.StatusOK, `{"kind":"Namespace","apiVersion":"v1","metadata":{"name":"x"}}`
		if strings.HasSuffix(r.URL.Path, "/missing") {
			code, body = http.StatusNotFound, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}`
		}
		return &http.Response{StatusCode: code, Header: http.Header{"Content-Type": {"application/json"}},
			Body: io.NopCloser(strings.NewReader(body)), Request: r}, nil
	})
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
