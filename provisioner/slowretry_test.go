package provisioner

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	volumehelpers "k8s.io/component-helpers/storage/volume"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func TestInfeasibleIsInvalidArgumentOnly(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{status.Error(codes.InvalidArgument, "bad"), true},
		{status.Error(codes.ResourceExhausted, "full"), false},
		{status.Error(codes.Internal, "x"), false},
		{status.Error(codes.DeadlineExceeded, "x"), false},
		{errors.New("not gRPC"), false},
	} {
		if got := isInfeasible(tc.err); got != tc.want {
			t.Errorf("%v: %v, want %v", tc.err, got, tc.want)
		}
	}
}

func TestSlowRetryWaitsTheWindowUnlessTheClassIsReplaced(t *testing.T) {
	t0 := time.Unix(1000, 0)
	const window = time.Minute
	for _, tc := range []struct {
		name     string
		marked   bool
		class    types.UID
		at       time.Duration // after the mark
		want     time.Duration
		wantKept bool
	}{
		{name: "nothing infeasible", class: "c1", want: 0},
		{name: "just failed", marked: true, class: "c1", at: 0, want: window, wantKept: true},
		{name: "within the window", marked: true, class: "c1", at: 20 * time.Second, want: 40 * time.Second, wantKept: true},
		{name: "window over", marked: true, class: "c1", at: window, want: 0},
		{name: "class replaced", marked: true, class: "c2", at: time.Second, want: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s slowRetries
			if tc.marked {
				s.mark("uid", "c1", t0)
			}
			if got := s.remaining("uid", tc.class, window, t0.Add(tc.at)); got != tc.want {
				t.Errorf("remaining %v, want %v", got, tc.want)
			}
			if _, kept := s.m["uid"]; kept != tc.wantKept {
				t.Errorf("remembered %v, want %v", kept, tc.wantKept)
			}
		})
	}
	var s slowRetries
	s.mark("uid", "c1", t0)
	s.forget("uid")
	if got := s.remaining("uid", "c1", window, t0); got != 0 {
		t.Errorf("after forget: %v", got)
	}
}

// Upstream's slow retry: after an InvalidArgument the claim's next CreateVolume waits
// --retry-interval-max (200ms here), not --retry-interval-start (20ms), and the event says
// so.
func TestAnInfeasibleCreateVolumeIsRetriedAfterTheMaximumInterval(t *testing.T) {
	w := newWorld(t, testdriver.Config{}, nil, class("fast", nil))
	if err := w.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: codes.InvalidArgument, Times: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.kube.CoreV1().PersistentVolumeClaims("ns").Create(context.Background(), claimFor("data", "uid-1", "fast"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the PersistentVolume", func() bool { return w.pv("pvc-uid-1") != nil })
	calls := w.calls(testdriver.MethodCreateVolume)
	if len(calls) < 2 || calls[0].Code != "InvalidArgument" {
		t.Fatalf("CreateVolume calls %+v, want an InvalidArgument, then more", calls)
	}
	if gap := calls[1].Start.Sub(calls[0].End); gap < w.ctrl.opts.retryIntervalMax-10*time.Millisecond {
		t.Errorf("retried %v after the infeasible request, want at least %v", gap, w.ctrl.opts.retryIntervalMax)
	}
	if !slices.ContainsFunc(w.events(), func(e string) bool { return strings.Contains(e, "infeasible error. Retries will be delayed") }) {
		t.Error("no event saying the retries are delayed")
	}
}

// A node deployment takes a free claim only when GetCapacity says its node has room, as
// upstream checks before it selects its node; a failure it counted is forgotten with the
// claim.
func TestANodeDeploymentTakesNoClaimItHasNoRoomFor(t *testing.T) {
	nd := &localNode{name: "n1", immediateBinding: true, baseDelay: time.Millisecond, maxDelay: 5 * time.Millisecond,
		failures: map[string]int{},
		info:     &csi.NodeGetInfoResponse{NodeId: "n1", AccessibleTopology: &csi.Topology{Segments: map[string]string{testdriver.TopologyKey: "n1"}}}}
	w := newWorld(t, testdriver.Config{Topology: true, TotalCapacity: 1 << 30}, func(c *config) { c.node = nd }, class("fast", nil))
	ctx := context.Background()
	claims := w.kube.CoreV1().PersistentVolumeClaims("ns")
	big := claimFor("big", "uid-big", "fast")
	big.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse("2Gi")
	if _, err := claims.Create(ctx, big, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the capacity check", func() bool { return len(w.calls(testdriver.MethodGetCapacity)) == 1 })
	// Another sync of the claim starts only once the first has decided.
	big, err := claims.Get(ctx, "big", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	big.Labels = map[string]string{"touched": "yes"}
	if _, err := claims.Update(ctx, big, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the second capacity check", func() bool { return len(w.calls(testdriver.MethodGetCapacity)) == 2 })
	if got, _ := claims.Get(ctx, "big", metav1.GetOptions{}); got.Annotations[volumehelpers.AnnSelectedNode] != "" {
		t.Fatalf("the node took a claim it has no room for: %v", got.Annotations)
	}
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 0 {
		t.Errorf("%d CreateVolume calls", n)
	}
	nd.mu.Lock()
	counted := nd.failures["uid-big"]
	nd.mu.Unlock()
	if counted == 0 {
		t.Error("attempts without room are not counted: the next waits no longer")
	}

	// A claim that fits is taken and provisioned.
	small := claimFor("small", "uid-small", "fast")
	small.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse("512Mi")
	if _, err := claims.Create(ctx, small, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the small claim provisioned", func() bool { return w.pv("pvc-uid-small") != nil })

	// The claim goes, and what was counted for it with it.
	if err := claims.Delete(ctx, "big", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the failures of the deleted claim forgotten", func() bool {
		nd.mu.Lock()
		defer nd.mu.Unlock()
		_, ok := nd.failures["uid-big"]
		return !ok
	})
}
