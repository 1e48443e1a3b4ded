package budget

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"
	"k8s.io/component-base/metrics"
)

// RESTMetrics are client-go's REST client metrics under the names, labels and buckets
// component-base gives them (rest_client_requests_total, rest_client_request_duration_seconds,
// rest_client_rate_limiter_duration_seconds), with one more label, sidecar, so that each
// hosted sidecar's clients have a series set of their own.
//
// client-go reports these through process-wide hooks that cannot tell one client from
// another, so the core measures them itself, in each client's transport. A sidecar's
// Budget therefore waits in the transport too, where the request's verb and
// host are known, instead of in client-go's rate limiter. The order is client-go's: the
// token first, then the request; no client with a budget has a request timeout that the
// wait could spend.
type RESTMetrics struct {
	requests *metrics.CounterVec
	duration *metrics.HistogramVec
	limiter  *metrics.HistogramVec
}

// NewRESTMetrics registers the REST client metrics in reg.
func NewRESTMetrics(reg metrics.KubeRegistry) *RESTMetrics {
	buckets := []float64{0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0}
	m := &RESTMetrics{
		requests: metrics.NewCounterVec(&metrics.CounterOpts{
			Name:           "rest_client_requests_total",
			Help:           "Number of HTTP requests, partitioned by status code, method, host and sidecar.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"code", "method", "host", "sidecar"}),
		duration: metrics.NewHistogramVec(&metrics.HistogramOpts{
			Name:           "rest_client_request_duration_seconds",
			Help:           "Request latency in seconds, from sending until the response headers. Broken down by verb, host and sidecar.",
			Buckets:        buckets,
			StabilityLevel: metrics.ALPHA,
		}, []string{"verb", "host", "sidecar"}),
		limiter: metrics.NewHistogramVec(&metrics.HistogramOpts{
			Name:           "rest_client_rate_limiter_duration_seconds",
			Help:           "Client side rate limiter latency in seconds: the wait for a token of the sidecar's --kube-api-qps/--kube-api-burst budget. Broken down by verb, host and sidecar.",
			Buckets:        buckets,
			StabilityLevel: metrics.ALPHA,
		}, []string{"verb", "host", "sidecar"}),
	}
	reg.MustRegister(m.requests, m.duration, m.limiter)
	return m
}

// Client returns a copy of cfg whose requests are counted and timed as sidecar's. With a
// budget b, every request waits for one of b's tokens first, timed, and client-go's own
// rate limiter is b's stand-in, which never waits; with none, cfg's limits stay as they are.
func (m *RESTMetrics) Client(cfg *rest.Config, sidecar string, b *Budget) *rest.Config {
	out := rest.CopyConfig(cfg)
	if b != nil {
		out.RateLimiter = budgetInTransport{b}
	}
	out.Wrap(func(next http.RoundTripper) http.RoundTripper {
		return &restTransport{next: next, metrics: m, sidecar: sidecar, budget: b}
	})
	return out
}

type restTransport struct {
	next    http.RoundTripper
	metrics *RESTMetrics
	sidecar string
	budget  *Budget
}

func (t *restTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	host := req.URL.Host
	if t.budget != nil {
		began := time.Now()
		if err := t.budget.Wait(req.Context()); err != nil {
			return nil, err
		}
		t.metrics.limiter.WithLabelValues(req.Method, host, t.sidecar).Observe(time.Since(began).Seconds())
	}
	began := time.Now()
	resp, err := t.next.RoundTrip(req)
	t.metrics.duration.WithLabelValues(req.Method, host, t.sidecar).Observe(time.Since(began).Seconds())
	code := "<error>"
	if err == nil {
		code = strconv.Itoa(resp.StatusCode)
	}
	t.metrics.requests.WithLabelValues(code, req.Method, host, t.sidecar).Inc()
	return resp, err
}

// budgetInTransport is client-go's rate limiter of a client whose budget waits in its
// transport: it lets every request through and reports the budget's QPS to whoever asks
// the client for its limiter.
type budgetInTransport struct{ b *Budget }

var _ flowcontrol.RateLimiter = budgetInTransport{}

func (budgetInTransport) TryAccept() bool                { return true }
func (budgetInTransport) Accept()                        {}
func (budgetInTransport) Stop()                          {}
func (l budgetInTransport) QPS() float32                 { return l.b.QPS() }
func (budgetInTransport) Wait(ctx context.Context) error { return nil }
