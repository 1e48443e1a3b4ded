package record

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apivalidation "k8s.io/apimachinery/pkg/api/validation"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
)

// largeClusterRequest is the CreateVolume request of an immediate-binding claim of a
// driver with per-node topology in a cluster of nodes nodes: every node's segment in the
// requisite and the preferred lists.
func largeClusterRequest(name string, nodes int) *csi.CreateVolumeRequest {
	req := objects.CreateVolumeRequest(name)
	req.AccessibilityRequirements = &csi.TopologyRequirement{}
	for i := range nodes {
		segment := &csi.Topology{Segments: map[string]string{"topology.local.csi.example.com/node": fmt.Sprintf("ip-10-0-%d-%d.eu-west-1.compute.internal", i/250, i%250)}}
		req.AccessibilityRequirements.Requisite = append(req.AccessibilityRequirements.Requisite, segment)
		req.AccessibilityRequirements.Preferred = append(req.AccessibilityRequirements.Preferred, segment)
	}
	return req
}

// refuseAsTheAPIServer refuses an event as the API server's validation does: annotations
// over 256 KiB in all are invalid (422).
func refuseAsTheAPIServer(action k8stesting.Action) (bool, runtime.Object, error) {
	ev := action.(k8stesting.CreateAction).GetObject().(*v1.Event)
	if errs := apivalidation.ValidateAnnotations(ev.Annotations, field.NewPath("metadata", "annotations")); len(errs) > 0 {
		return true, nil, apierrors.NewInvalid(schema.GroupKind{Kind: "Event"}, ev.Name, errs)
	}
	return false, nil, nil
}

// writeTogether writes the records of n claims while the first one's event is held, so
// that the others wait together and go in the next event(s); it returns each write's error
// and the number of events created.
func writeTogether(t *testing.T, n int, req func(uid string) *csi.CreateVolumeRequest, reactors ...k8stesting.ReactionFunc) ([]error, *Store, int32) {
	t.Helper()
	kube := fake.NewClientset()
	release := make(chan struct{})
	var creates, refused atomic.Int32
	kube.PrependReactor("create", "events", func(action k8stesting.Action) (bool, runtime.Object, error) {
		if creates.Add(1) == 1 {
			<-release
		}
		for _, r := range reactors {
			if handled, obj, err := r(action); handled {
				refused.Add(1)
				return handled, obj, err
			}
		}
		return false, nil, nil
	})
	s, err := NewStore(StoreConfig{Kube: kube, Driver: drv, Source: v1.EventSource{Component: "test"}})
	if err != nil {
		t.Fatal(err)
	}
	errs := make([]error, n)
	done := make(chan int, n)
	write := func(i int) {
		c := claimFor(fmt.Sprintf("c%d", i), fmt.Sprintf("uid-%d", i), "fast")
		rec, err := New(drv, "", nil, req(string(c.UID)))
		if err == nil {
			err = s.writer.writeRecord(context.Background(), c, rec)
		}
		errs[i] = err
		done <- i
	}
	go write(0)
	if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return creates.Load() == 1, nil
	}); err != nil {
		t.Fatal("the first record's event was not written")
	}
	for i := 1; i < n; i++ {
		go write(i)
	}
	if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		s.writer.batches.mu.Lock()
		defer s.writer.batches.mu.Unlock()
		return len(s.writer.batches.waiting["ns"]) == n-1, nil
	}); err != nil {
		t.Fatal("the other records did not wait for the first event")
	}
	close(release)
	for range n {
		<-done
	}
	return errs, s, creates.Load() - refused.Load()
}

// A StatefulSet's scale-up in a cluster of 150 nodes of a driver with per-node topology:
// records that waited together are weighed, so that no event exceeds what the API server
// accepts, and every claim's record is kept.
func TestRecordsOfALargeClusterAreWeighedIntoEventsTheAPIServerAccepts(t *testing.T) {
	const claims = 40
	errs, s, events := writeTogether(t, claims, func(uid string) *csi.CreateVolumeRequest {
		return largeClusterRequest("pvc-"+uid, 150)
	}, refuseAsTheAPIServer)
	for i, err := range errs {
		if err != nil {
			t.Errorf("claim c%d: %v", i, err)
		}
	}
	for i := range claims {
		if r, err := s.Open(fmt.Sprintf("uid-%d", i)); err != nil || r == nil {
			t.Errorf("claim c%d: no open record (%v)", i, err)
		}
	}
	if events > claims/2 {
		t.Errorf("%d events for %d records, want batches as large as the API server allows", events, claims)
	}
}

// A server whose limit is lower than the weighing assumes refuses a batch as invalid: it is
// written again in halves, down to events of one record each.
func TestABatchRefusedAsTooLargeIsWrittenInSmallerEvents(t *testing.T) {
	const claims = 9
	var seen atomic.Int32
	smallLimit := func(action k8stesting.Action) (bool, runtime.Object, error) {
		ev := action.(k8stesting.CreateAction).GetObject().(*v1.Event)
		seen.Add(1)
		if len(ev.Annotations[AnnAlso]) > 2<<10 {
			return true, nil, apierrors.NewInvalid(schema.GroupKind{Kind: "Event"}, ev.Name, field.ErrorList{field.TooLong(field.NewPath("metadata", "annotations"), "", 2<<10)})
		}
		return false, nil, nil
	}
	errs, s, _ := writeTogether(t, claims, func(uid string) *csi.CreateVolumeRequest {
		return objects.CreateVolumeRequest("pvc-" + uid)
	}, smallLimit)
	for i, err := range errs {
		if err != nil {
			t.Errorf("claim c%d: %v", i, err)
		}
		if r, err := s.Open(fmt.Sprintf("uid-%d", i)); err != nil || r == nil {
			t.Errorf("claim c%d: no open record (%v)", i, err)
		}
	}
	if seen.Load() < 3 {
		t.Errorf("%d creates, want the refused batch split and written again", seen.Load())
	}
}
