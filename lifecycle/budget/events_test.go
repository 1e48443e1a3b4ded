package budget

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	k8smetrics "k8s.io/component-base/metrics"
)

// Events are informational (P14): the event recorder's writes, which spend the sidecar's
// budget, wait behind a write that records a CSI call's result, whenever each came, and
// ahead of a request that starts new work, which cannot starve them.
func TestRecorderEventsWaitBehindResultsAndAheadOfNewWork(t *testing.T) {
	var mu sync.Mutex
	var served []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		what, body := "new work", `{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"volume","namespace":"ns"}}`
		switch {
		case strings.Contains(r.URL.Path, "/events"):
			what, body = "event", `{"kind":"Event","apiVersion":"v1","metadata":{"name":"volume.1","namespace":"ns"}}`
		case r.Method == http.MethodPut:
			what = "result"
		}
		mu.Lock()
		served = append(served, what)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		if r.Method == http.MethodPost {
			w.WriteHeader(http.StatusCreated)
		}
		_, _ = io.WriteString(w, body)
	}))
	defer srv.Close()
	b := newBudget(5, 1)
	// The dispatcher starts once all three wait.
	b.mu.Lock()
	b.started = true
	b.mu.Unlock()
	kube, err := kubernetes.NewForConfig(NewRESTMetrics(k8smetrics.NewKubeRegistry()).Client(&rest.Config{Host: srv.URL}, "test", b))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	events := NewEventBroadcaster(ctx, kube, "")
	defer events.Shutdown()
	recorder := events.NewRecorder(scheme.Scheme, v1.EventSource{Component: "test"})
	obj := &v1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "volume", Namespace: "ns", UID: "uid"}}

	// A burst of events: the recorder writes them one at a time, the first waits now.
	for _, reason := range []string{"AttachFailed", "DetachFailed", "Resizing", "ExternalExpanding", "Provisioning"} {
		recorder.Event(obj, v1.EventTypeWarning, reason, "a driver call failed")
	}
	waitForWaiters(t, b, 1)
	var wg sync.WaitGroup
	wg.Go(func() {
		starting, done := StartingWork(context.Background(), context.Background())
		defer done()
		if _, err := kube.CoreV1().ConfigMaps("ns").Create(starting, obj, metav1.CreateOptions{}); err != nil {
			t.Error(err)
		}
	})
	waitForWaiters(t, b, 2)
	wg.Go(func() {
		if _, err := kube.CoreV1().ConfigMaps("ns").Update(context.Background(), obj, metav1.UpdateOptions{}); err != nil {
			t.Error(err)
		}
	})
	waitForWaiters(t, b, 3)
	go b.dispatch()
	wg.Wait()

	mu.Lock()
	got := slices.Clone(served)
	mu.Unlock()
	if i := slices.Index(got, "result"); i != 0 {
		t.Errorf("served %v: the result write waited behind %d requests, want none", got, i)
	}
	if i, j := slices.Index(got, "event"), slices.Index(got, "new work"); i < 0 || i > j {
		t.Errorf("served %v: want the waiting event served before new work", got)
	}
}
