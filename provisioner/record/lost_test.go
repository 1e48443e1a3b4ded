package record

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
)

// notKeptLog collects what a store reports of the records it could not keep.
type notKeptLog struct {
	mu      sync.Mutex
	volumes []string
	errs    []error
}

func (l *notKeptLog) add(_ v1.ObjectReference, volume string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.volumes, l.errs = append(l.volumes, volume), append(l.errs, err)
}

func withCancel(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithCancel(ctx)
}

// An API server that refuses the record's event (EventRateLimit admission, a count/events
// quota) does not stop the provisioning: upstream provisions there, so does this, and the
// record that could not be kept is reported.
func TestARefusedRecordIsReportedAndTheProvisioningGoesOn(t *testing.T) {
	for name, refusal := range map[string]error{
		"EventRateLimit": apierrors.NewTooManyRequestsError("limit reached on type Namespace for key ns"),
		"quota":          apierrors.NewForbidden(v1.Resource("events"), "e", errors.New("exceeded quota: events, requested: count/events=1, used: count/events=100, limited: count/events=100")),
	} {
		t.Run(name, func(t *testing.T) {
			kube := fake.NewClientset()
			var accepting atomic.Bool
			kube.PrependReactor("create", "events", func(k8stesting.Action) (bool, runtime.Object, error) { return !accepting.Load(), nil, refusal })
			var reported notKeptLog
			s, err := NewStore(StoreConfig{Kube: kube, Driver: drv, Source: v1.EventSource{Component: "test"}, StartingWork: withCancel, NotKept: reported.add})
			if err != nil {
				t.Fatal(err)
			}
			claim := claimFor("data", recordUID, "fast")
			rec := testRecord(t, "")
			if err := s.Opening(context.Background(), claim, rec); err != nil {
				t.Fatalf("Opening: %v, want the provisioning to go on without its record", err)
			}
			if len(reported.volumes) != 1 || reported.volumes[0] != rec.Volume || !errors.Is(reported.errs[0], ErrNotKept) || !Refused(reported.errs[0]) {
				t.Errorf("reported %q, %v; want volume %s reported once as not kept, with the server's answer", reported.volumes, reported.errs, rec.Volume)
			}
			// It stays open in memory, and the leader retries it (with its queue's
			// backoff) until an event keeps it; the refusal is reported once.
			if r, err := s.Open(recordUID); r == nil || err != nil || r.Record.Volume != rec.Volume {
				t.Fatalf("the refused record is not open in memory: %+v, %v", r, err)
			}
			if err := s.lost.rewrite(context.Background(), recordUID); !Refused(err) {
				t.Errorf("a retry the server refuses again: %v, want its refusal for the queue's backoff", err)
			}
			if len(reported.volumes) != 1 {
				t.Errorf("the refusal reported %d times, want once", len(reported.volumes))
			}
			accepting.Store(true)
			if err := s.lost.rewrite(context.Background(), recordUID); err != nil {
				t.Fatal(err)
			}
			if events, _ := s.own.ByIndex(recordClaimIndex, recordUID); len(events) != 1 {
				t.Errorf("%d events keep the record once the server accepts it, want 1", len(events))
			}
		})
	}
	// An API server that cannot be reached refuses nothing: the write fails and is retried.
	kube := fake.NewClientset()
	kube.PrependReactor("create", "events", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewServiceUnavailable("etcd is down")
	})
	var reported notKeptLog
	s, _ := NewStore(StoreConfig{Kube: kube, Driver: drv, Source: v1.EventSource{Component: "test"}, StartingWork: withCancel, NotKept: reported.add})
	if err := s.Opening(context.Background(), claimFor("data", recordUID, "fast"), testRecord(t, "")); err == nil || len(reported.volumes) != 0 {
		t.Errorf("an unavailable API server: Opening %v, reported %q; want an error to retry and no report", err, reported.volumes)
	}
}

// A record whose event disappears while it is open (an --event-ttl shorter than the
// provisioning, `kubectl delete events`) is noticed, stays open, and is written again; the
// event of a closed record may go.
func TestAnOpenRecordWhoseEventDisappearsIsNoticedAndWrittenAgain(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	kube := fake.NewClientset()
	lost := make(chan string, 4)
	s, err := NewStore(StoreConfig{Kube: kube, Driver: drv, Source: v1.EventSource{Component: "test"}, StartingWork: withCancel,
		Lost: func(uid string) { lost <- uid }})
	if err != nil {
		t.Fatal(err)
	}
	s.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), s.HasSynced) {
		t.Fatal("no cache")
	}
	open, done := claimFor("open", recordUID, "fast"), claimFor("done", "uid-done", "fast")
	for _, c := range []*v1.PersistentVolumeClaim{open, done} {
		rec, err := New(drv, "", nil, largeClusterRequest("pvc-"+string(c.UID), 3))
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Opening(ctx, c, rec); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.CloseFor(ctx, "uid-done", done, nil, v1.EventTypeNormal, ReasonSucceeded, "done"); err != nil {
		t.Fatal(err)
	}
	cached := func(n int) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			return len(s.informer.GetStore().List()) == n, nil
		}); err != nil {
			t.Fatalf("the cache holds %d events, want %d", len(s.informer.GetStore().List()), n)
		}
	}
	cached(3)
	// The API server removes the opening events (their TTL ran out), then the closing one.
	list, _ := kube.CoreV1().Events("ns").List(ctx, metav1.ListOptions{})
	for _, ev := range list.Items {
		if ev.Reason == ReasonProvisioning {
			if err := kube.CoreV1().Events("ns").Delete(ctx, ev.Name, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	cached(1)
	select {
	case uid := <-lost:
		if uid != recordUID {
			t.Fatalf("claim %s told lost, want %s", uid, recordUID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the disappearance of the open record's event was not noticed")
	}
	if r, err := s.Open(recordUID); r == nil || err != nil || r.Record.Volume != "pvc-"+recordUID || r.Record.Claim.Name != "open" {
		t.Fatalf("the lost record is not open: %+v, %v", r, err)
	}
	if !s.Aging(recordUID) {
		t.Error("a lost record does not count as aging: a retry of its CreateVolume would not write it again")
	}
	if err := s.lost.rewrite(ctx, recordUID); err != nil {
		t.Fatal(err)
	}
	cached(2)
	events, _ := s.own.ByIndex(recordClaimIndex, recordUID)
	if r, err := OpenAmong(events, recordUID); r == nil || err != nil || r.Record.Volume != "pvc-"+recordUID {
		t.Errorf("no event opens the record again: %+v, %v", r, err)
	}
	if _, ok := s.lost.get(recordUID); ok {
		t.Error("the record is still counted lost once its event is written again")
	}
	// The informer tells of events in order: once the rewritten event's own deletion is
	// told, every deletion before it was, and the closed record's was told nothing.
	list, _ = kube.CoreV1().Events("ns").List(ctx, metav1.ListOptions{})
	for _, ev := range list.Items {
		if ev.Reason == ReasonProvisioning {
			if err := kube.CoreV1().Events("ns").Delete(ctx, ev.Name, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	select {
	case uid := <-lost:
		if uid != recordUID {
			t.Errorf("claim %s told lost, but its record was closed", uid)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the disappearance of the rewritten event was not noticed")
	}
}
