package resizer

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/util/workqueue"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The watch event of the controller's own status write is an ordinary update, not a resync:
// it must not requeue a failing PVC at once, past its backoff, even when every failure
// writes (the driver's message changes each time). Otherwise a driver that keeps failing
// is called in a loop.
func TestOwnWriteEventsDoNotBypassBackoff(t *testing.T) {
	f, c, _ := growingClaim(t, testdriver.Config{}, "2Gi")
	f.handled(c.queue, "start")

	for attempt := range 3 {
		fault := testdriver.Fault{Method: testdriver.MethodControllerExpandVolume, Code: codes.Internal, Message: fmt.Sprintf("failure %d", attempt), Times: 1}
		if err := f.driver.InjectFault(fault); err != nil {
			t.Fatal(err)
		}
		f.writes()
		if err := c.sync("ns/claim"); err == nil {
			t.Fatalf("attempt %d: sync succeeded against a failing driver", attempt)
		}
		if f.writes() == 0 {
			t.Fatalf("attempt %d: the failure wrote nothing; the test needs a write per failure", attempt)
		}
		if queued := f.handled(c.queue, fmt.Sprint(attempt)); len(queued) != 0 {
			t.Fatalf("attempt %d: %q queued by the watch events of the controller's own writes, without backoff", attempt, queued)
		}
	}
	if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 3 {
		t.Errorf("%d ControllerExpandVolume calls, want the 3 the test made", n)
	}
}

// A sync that comes before the informers show the controller's own writes (here: they
// never do) starts from what was written: the volume is not expanded a second time and
// nothing is written again. With node expansion the stale copy that matters is the PV's:
// its old capacity says the controller part is not done.
func TestStaleCacheDoesNotExpandAgain(t *testing.T) {
	for _, node := range []bool{false, true} {
		t.Run(fmt.Sprintf("node expansion %v", node), func(t *testing.T) {
			f := newFixture(t, testdriver.Config{NodeExpansionRequired: node})
			id := f.createVolume("vol", gi(1))
			pvc, pv := boundPair("claim", id, "2Gi", "1Gi")
			f, c := newExpansionFixtureWith(t, f, expansionOpts{}, pvc, pv)
			stallWatches(f.kube, "persistentvolumeclaims", "persistentvolumes")
			f.start()
			drain(c.queue)

			if err := c.sync("ns/claim"); err != nil {
				t.Fatalf("first sync: %v", err)
			}
			if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 1 {
				t.Fatalf("%d calls, want 1", n)
			}
			cached, err := f.factory.Core().V1().PersistentVolumeClaims().Lister().PersistentVolumeClaims("ns").Get("claim")
			if err != nil {
				t.Fatal(err)
			}
			cachedPV, err := f.factory.Core().V1().PersistentVolumes().Lister().Get("pv-claim")
			if err != nil {
				t.Fatal(err)
			}
			if api := f.pv("pv-claim"); cachedPV.ResourceVersion == api.ResourceVersion {
				t.Fatalf("the PV informer shows the written PV (%s): the test needs a stale cache; %v", api.ResourceVersion, f.kube.Actions())
			}
			f.writes()

			// A resync delivers the cached PVC; the sync it queues must find nothing to do.
			c.claimUpdated(cached, cached)
			for c.queue.Len() > 0 {
				key := nextKey(t, c.queue)
				if err := c.sync(key); err != nil {
					t.Errorf("sync of %s from the stale cache: %v", key, err)
				}
			}
			if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 1 {
				t.Errorf("%d ControllerExpandVolume calls, want 1: the stale cache was taken for work to do", n)
			}
			if n := f.writes(); n != 0 {
				t.Errorf("%d writes from the stale cache, want 0", n)
			}
		})
	}
}

// stallWatches makes the informers of resources list once and then hear nothing.
func stallWatches(kube *fake.Clientset, resources ...string) {
	for _, r := range resources {
		kube.PrependWatchReactor(r, func(k8stesting.Action) (bool, watch.Interface, error) {
			return true, watch.NewFake(), nil
		})
	}
}

// handled waits until the PVC handlers have handled every PVC event so far and returns
// the keys they queued meanwhile (taken from q). A handler gets events in the order they
// happened, so once it has queued a PVC created now, it has handled the events before.
func (f *fixture) handled(q workqueue.TypedRateLimitingInterface[string], marker string) []string {
	f.t.Helper()
	name := "marker-" + marker
	if _, err := f.kube.CoreV1().PersistentVolumeClaims("ns").Create(context.Background(),
		&v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name}}, metav1.CreateOptions{}); err != nil {
		f.t.Fatal(err)
	}
	var queued []string
	for {
		key := nextKey(f.t, q)
		if key == "ns/"+name {
			return queued
		}
		if !strings.HasPrefix(key, "ns/marker-") {
			queued = append(queued, key)
		}
	}
}

// drain empties a queue of what the informers' initial adds put there.
func drain(q workqueue.TypedRateLimitingInterface[string]) {
	for q.Len() > 0 {
		key, _ := q.Get()
		q.Done(key)
	}
}

// nextKey waits for a key in q and takes it.
func nextKey(t *testing.T, q workqueue.TypedRateLimitingInterface[string]) string {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		return q.Len() > 0, nil
	}); err != nil {
		t.Fatal("nothing queued")
	}
	key, _ := q.Get()
	q.Done(key)
	return key
}
