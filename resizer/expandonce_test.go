package resizer

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// A ControllerExpandVolume that succeeded is not sent again when recording it must be
// retried. Under the real control loop someone else may write the PVC while the driver
// expands its volume (a label, an annotation of kube-controller-manager), so the status
// write that records the expansion, guarded by the resourceVersion, meets a conflict; or
// the PV's capacity write fails. The retry, from a cache that shows the other write, found
// the resize still ControllerResizeInProgress, and expanded again.
func TestAnExpansionIsNotRepeatedWhenItsRecordingIsRetried(t *testing.T) {
	for _, tc := range []struct {
		name          string
		nodeExpansion bool
		// failPV: the PV's capacity write fails once; otherwise someone else writes the
		// PVC during the call.
		failPV bool
	}{
		{name: "the PVC written by someone else during the call"},
		{name: "the PVC written by someone else during the call, node expansion required", nodeExpansion: true},
		{name: "the PV write fails once", failPV: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, testdriver.Config{NodeExpansionRequired: tc.nodeExpansion})
			id := f.createVolume("vol", gi(1))
			pvc, pv := boundPair("claim", id, "2Gi", "1Gi")
			f, c := newExpansionFixtureWith(t, f, expansionOpts{}, pvc, pv)
			if tc.failPV {
				var once sync.Once
				f.kube.PrependReactor("patch", "persistentvolumes", func(k8stesting.Action) (handled bool, _ runtime.Object, err error) {
					once.Do(func() { handled, err = true, apierrors.NewInternalError(errors.New("etcd hiccup")) })
					return handled, nil, err
				})
			} else {
				c.expander = &thenExpander{expander: c.expander, then: func() {
					claim := f.pvc("claim")
					claim.Labels = map[string]string{"team": "storage"}
					if _, err := f.kube.CoreV1().PersistentVolumeClaims("ns").Update(context.Background(), claim, metav1.UpdateOptions{}); err != nil {
						t.Error(err)
					}
				}}
			}
			f.start()

			if err := c.sync("ns/claim"); err == nil {
				t.Fatal("first sync succeeded; the test needs its recording to fail")
			}
			if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 1 {
				t.Fatalf("%d ControllerExpandVolume calls after the first sync, want 1", n)
			}
			f.settle()
			if err := c.sync("ns/claim"); err != nil {
				t.Fatalf("retry: %v", err)
			}

			if calls := f.calls(testdriver.MethodControllerExpandVolume); len(calls) != 1 {
				t.Errorf("ControllerExpandVolume calls %+v, want exactly one", calls)
			}
			if c := f.pv("pv-claim").Spec.Capacity[v1.ResourceStorage]; c.Cmp(resource.MustParse("2Gi")) != 0 {
				t.Errorf("PV capacity %s, want 2Gi", c.String())
			}
			got := f.pvc("claim")
			capacity, state := got.Status.Capacity[v1.ResourceStorage], got.Status.AllocatedResourceStatuses[v1.ResourceStorage]
			wantCapacity, wantState := "2Gi", v1.ClaimResourceStatus("")
			if tc.nodeExpansion {
				wantCapacity, wantState = "1Gi", v1.PersistentVolumeClaimNodeResizePending
			}
			if capacity.Cmp(resource.MustParse(wantCapacity)) != 0 || state != wantState {
				t.Errorf("PVC capacity %s, resize status %q; want %s, %q", capacity.String(), state, wantCapacity, wantState)
			}
			events := f.events()
			resizing := 0
			for _, e := range events {
				if strings.HasPrefix(e, "Normal Resizing") {
					resizing++
				}
			}
			if resizing != 1 {
				t.Errorf("events %q, want one Resizing", events)
			}
		})
	}
}

// thenExpander runs then once, after the first expansion returned.
type thenExpander struct {
	expander
	once sync.Once
	then func()
}

func (e *thenExpander) expand(ctx context.Context, pv *v1.PersistentVolume, size int64) (int64, bool, error) {
	reached, node, err := e.expander.expand(ctx, pv, size)
	e.once.Do(e.then)
	return reached, node, err
}
