package resizer

import (
	"cmp"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// resyncOutcome is what one resync of the PVC "ns/claim" led to.
type resyncOutcome struct {
	calls, writes, events int
}

// resyncClaim delivers a resync of ns/claim (the informer hands its cached copy as both old
// and new) to update, then runs the syncs it queued, as the workers would.
func (f *fixture) resyncClaim(update func(old, new any), queue interface {
	Len() int
	Get() (string, bool)
	Done(string)
}, sync func(string) error, method string) resyncOutcome {
	f.t.Helper()
	f.settle()
	cached, err := f.factory.Core().V1().PersistentVolumeClaims().Lister().PersistentVolumeClaims("ns").Get("claim")
	if err != nil {
		f.t.Fatal(err)
	}
	calls := len(f.calls(method))
	f.writes()
	f.events()
	update(cached, cached)
	for queue.Len() > 0 {
		key, _ := queue.Get()
		_ = sync(key)
		queue.Done(key)
	}
	return resyncOutcome{calls: len(f.calls(method)) - calls, writes: f.writes(), events: len(f.events())}
}

// A resync (same resourceVersion) of a PVC with nothing to do costs no driver call, no
// write and no event; one whose work is due (a retry whose wait is over, an operation a
// previous leader left in progress) gets it; a PVC whose failure waits for its backoff is
// not queued past it.
func TestExpansionResync(t *testing.T) {
	fault := func(t *testing.T, f *fixture, code codes.Code) {
		if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerExpandVolume, Code: code, Times: 1}); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name string
		opts expansionOpts
		cfg  testdriver.Config
		// prepare brings ns/claim (2Gi asked, 1Gi had) to the state to resync.
		prepare   func(t *testing.T, f *fixture, c *expansionController)
		wantCalls int
	}{
		{name: "resized", prepare: func(t *testing.T, f *fixture, c *expansionController) {
			mustSync(t, c.sync)
		}},
		{name: "waiting for the node", cfg: testdriver.Config{NodeExpansionRequired: true}, prepare: func(t *testing.T, f *fixture, c *expansionController) {
			mustSync(t, c.sync)
		}},
		{name: "infeasible moments ago", prepare: func(t *testing.T, f *fixture, c *expansionController) {
			fault(t, f, codes.OutOfRange)
			mustSync(t, c.sync)
		}},
		{name: "infeasible, wait over: due", wantCalls: 1, prepare: func(t *testing.T, f *fixture, c *expansionController) {
			fault(t, f, codes.OutOfRange)
			mustSync(t, c.sync)
			c.attempts.retryMax = 0 // as if --retry-interval-max had passed
		}},
		{name: "failed, backoff pending", opts: expansionOpts{retryStart: time.Hour}, prepare: func(t *testing.T, f *fixture, c *expansionController) {
			fault(t, f, codes.Internal)
			if err := c.sync("ns/claim"); err == nil {
				t.Fatal("want a failure")
			}
			c.queue.AddRateLimited("ns/claim") // what the worker does with the error
		}},
		{name: "in use by a running Pod", opts: expansionOpts{handleInUse: true}, prepare: func(t *testing.T, f *fixture, c *expansionController) {
			f.add(podUsing("app", "claim"))
			f.settle()
			fault(t, f, codes.FailedPrecondition)
			mustSync(t, c.sync)
			// The first sync of the refused PVC tells the user it waits for the Pod.
			f.settle()
			mustSync(t, c.sync)
		}},
		{name: "left in progress by a previous leader: due", wantCalls: 1, prepare: func(t *testing.T, f *fixture, c *expansionController) {
			pvc := f.pvc("claim")
			pvc.Status.AllocatedResources = v1.ResourceList{v1.ResourceStorage: resource.MustParse("2Gi")}
			pvc.Status.AllocatedResourceStatuses = map[v1.ResourceName]v1.ClaimResourceStatus{v1.ResourceStorage: v1.PersistentVolumeClaimControllerResizeInProgress}
			f.updateClaim(pvc)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, tc.cfg)
			id := f.createVolume("vol", gi(1))
			pvc, pv := boundPair("claim", id, "2Gi", "1Gi")
			f, c := newExpansionFixtureWith(t, f, tc.opts, pvc, pv)
			f.start()
			f.handled(c.queue, "start")
			tc.prepare(t, f, c)
			f.handled(c.queue, "prepared")

			got := f.resyncClaim(c.claimUpdated, c.queue, c.sync, testdriver.MethodControllerExpandVolume)
			if got.calls != tc.wantCalls {
				t.Errorf("%d ControllerExpandVolume calls, want %d", got.calls, tc.wantCalls)
			}
			if tc.wantCalls == 0 && (got.writes != 0 || got.events != 0) {
				t.Errorf("%d writes and %d events with nothing to do, want none", got.writes, got.events)
			}
		})
	}
}

// The same for modification.
func TestModifyResync(t *testing.T) {
	fault := func(t *testing.T, f *fixture, code codes.Code) {
		if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerModifyVolume, Code: code, Times: 1}); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name       string
		noGold     bool
		retryStart time.Duration // 0: the fixture's 1ms
		prepare    func(t *testing.T, f *fixture, c *modifyController)
		wantCalls  int
	}{
		{name: "modified", prepare: func(t *testing.T, f *fixture, c *modifyController) {
			mustSync(t, c.sync)
		}},
		{name: "pending until the class exists", noGold: true, prepare: func(t *testing.T, f *fixture, c *modifyController) {
			mustSync(t, c.sync)
		}},
		{name: "infeasible moments ago", prepare: func(t *testing.T, f *fixture, c *modifyController) {
			fault(t, f, codes.InvalidArgument)
			mustSync(t, c.sync)
		}},
		{name: "failed, backoff pending", retryStart: time.Hour, prepare: func(t *testing.T, f *fixture, c *modifyController) {
			fault(t, f, codes.Internal)
			if err := c.sync("ns/claim"); err == nil {
				t.Fatal("want a failure")
			}
			// What the worker does with the error. The backoff's first step is long (capped
			// at the fixture's one-minute maximum): with a short one the retry would come
			// due during the resync and pass for a sync the resync queued.
			c.queue.AddRateLimited("ns/claim")
		}},
		{name: "left in progress by a previous leader: due", wantCalls: 1, prepare: func(t *testing.T, f *fixture, c *modifyController) {
			pvc := f.pvc("claim")
			pvc.Status.ModifyVolumeStatus = &v1.ModifyVolumeStatus{TargetVolumeAttributesClassName: "gold", Status: v1.PersistentVolumeClaimModifyVolumeInProgress}
			f.updateClaim(pvc)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, testdriver.Config{})
			pvc, pv, _ := f.modifyPair("silver", "gold")
			retryStart := cmp.Or(tc.retryStart, time.Millisecond)
			var c *modifyController
			if tc.noGold {
				c = newModifyFixtureRetry(t, f, false, retryStart, pvc, pv, class("silver", "100"))
			} else {
				c = newModifyFixtureRetry(t, f, false, retryStart, pvc, pv, class("silver", "100"), class("gold", "500"))
			}
			f.handled(c.queue, "start")
			tc.prepare(t, f, c)
			f.handled(c.queue, "prepared")

			got := f.resyncClaim(c.claimUpdated, c.queue, c.sync, testdriver.MethodControllerModifyVolume)
			if got.calls != tc.wantCalls {
				t.Errorf("%d ControllerModifyVolume calls, want %d", got.calls, tc.wantCalls)
			}
			if tc.wantCalls == 0 && (got.writes != 0 || got.events != 0) {
				t.Errorf("%d writes and %d events with nothing to do, want none", got.writes, got.events)
			}
			if tc.wantCalls > 0 && ptr.Deref(f.pvc("claim").Status.CurrentVolumeAttributesClassName, "") != "gold" {
				t.Errorf("due modification not done: %+v", f.pvc("claim").Status)
			}
		})
	}
}

func mustSync(t *testing.T, sync func(string) error) {
	t.Helper()
	if err := sync("ns/claim"); err != nil {
		t.Fatalf("sync: %v", err)
	}
}
