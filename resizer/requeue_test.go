package resizer

import (
	"context"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// A bound PVC whose PV the informer does not show yet is retried with backoff until it
// does, as upstream: nothing else enqueues the PVC when the PV arrives, so dropping it
// would leave the work to the next resync (here: none).
func TestPVNotYetCachedIsRetried(t *testing.T) {
	for _, tc := range []struct {
		name   string
		method string
		start  func(t *testing.T, f *fixture, pvc *v1.PersistentVolumeClaim) (run func(context.Context), requeues func() int)
		done   func(f *fixture) bool
	}{
		{
			name:   "expansion",
			method: testdriver.MethodControllerExpandVolume,
			start: func(t *testing.T, f *fixture, pvc *v1.PersistentVolumeClaim) (func(context.Context), func() int) {
				_, c := newExpansionFixtureWith(t, f, expansionOpts{}, pvc)
				return func(ctx context.Context) { c.run(ctx, 1) }, func() int { return c.queue.NumRequeues("ns/claim") }
			},
			done: func(f *fixture) bool {
				capacity := f.pvc("claim").Status.Capacity[v1.ResourceStorage]
				return capacity.String() == "2Gi"
			},
		},
		{
			name:   "modification",
			method: testdriver.MethodControllerModifyVolume,
			start: func(t *testing.T, f *fixture, pvc *v1.PersistentVolumeClaim) (func(context.Context), func() int) {
				pvc.Spec.Resources.Requests[v1.ResourceStorage] = pvc.Status.Capacity[v1.ResourceStorage]
				pvc.Spec.VolumeAttributesClassName = ptr.To("gold")
				pvc.Status.CurrentVolumeAttributesClassName = ptr.To("silver")
				f.add(class("silver", "100"), class("gold", "500"))
				c, err := newModifyController(modifyConfig{
					controllerConfig: controllerConfig{writer: f.w, informers: f.factory, retryStart: time.Millisecond, retryMax: time.Minute},
					modifier:         &modifier{client: f.controllerClient(), kube: f.kube},
				})
				if err != nil {
					t.Fatal(err)
				}
				f.add(pvc)
				t.Cleanup(c.queue.ShutDown)
				return func(ctx context.Context) { c.run(ctx, 1) }, func() int { return c.queue.NumRequeues("ns/claim") }
			},
			done: func(f *fixture) bool {
				return ptr.Deref(f.pvc("claim").Status.CurrentVolumeAttributesClassName, "") == "gold"
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, testdriver.Config{})
			id := f.createVolume("vol", gi(1))
			pvc, pv := boundPair("claim", id, "2Gi", "1Gi")
			pv.Spec.VolumeAttributesClassName = ptr.To("silver")
			run, requeues := tc.start(t, f, pvc)
			f.start()
			ctx, cancel := context.WithCancel(context.Background())
			stopped := make(chan struct{})
			go func() { defer close(stopped); run(ctx) }()
			t.Cleanup(func() { cancel(); <-stopped })

			if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
				return requeues() > 0, nil
			}); err != nil {
				t.Fatal("the PVC was not requeued while its PV is missing from the informer")
			}
			if n := len(f.calls(tc.method)); n != 0 {
				t.Fatalf("%d %s calls without the PV", n, tc.method)
			}
			if _, err := f.kube.CoreV1().PersistentVolumes().Create(context.Background(), pv, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
				return tc.done(f), nil
			}); err != nil {
				t.Fatalf("not done once the PV is there: PVC status %+v, calls %+v", f.pvc("claim").Status, f.calls(tc.method))
			}
		})
	}
}

// A PVC with nothing to do is not retried for a PV the informer does not show: a PVC of
// another driver, or one whose PV is gone, would otherwise be retried for ever.
func TestPVNotCachedNothingToDo(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	pvc, _ := boundPair("claim", "vol", "1Gi", "1Gi")
	_, exp := newExpansionFixtureWith(t, f, expansionOpts{}, pvc)
	mod := newModifyFixtureWith(t, f, false)
	if err := exp.sync("ns/claim"); err != nil {
		t.Errorf("expansion: %v, want nil (nothing to do)", err)
	}
	if err := mod.sync("ns/claim"); err != nil {
		t.Errorf("modification: %v, want nil (nothing to do)", err)
	}
}

// With RecoverVolumeExpansionFailure, a change of the PVC's resize status that the kubelet
// writes enqueues the PVC (upstream enqueues every change); the ones the controller writes
// itself do not, so that its own writes never run a PVC past a failure's backoff.
func TestExpansionEnqueuesKubeletResizeStatus(t *testing.T) {
	const (
		none                = v1.ClaimResourceStatus("")
		controllerProgress  = v1.PersistentVolumeClaimControllerResizeInProgress
		controllerInfeasble = v1.PersistentVolumeClaimControllerResizeInfeasible
		nodePending         = v1.PersistentVolumeClaimNodeResizePending
		nodeProgress        = v1.PersistentVolumeClaimNodeResizeInProgress
		nodeInfeasible      = v1.PersistentVolumeClaimNodeResizeInfeasible
	)
	for _, tc := range []struct {
		name     string
		from, to v1.ClaimResourceStatus
		want     bool
	}{
		{name: "kubelet: node expansion infeasible", from: nodeProgress, to: nodeInfeasible, want: true},
		{name: "kubelet: infeasible straight from pending", from: nodePending, to: nodeInfeasible, want: true},
		{name: "kubelet: node expansion started", from: nodePending, to: nodeProgress, want: true},
		{name: "unchanged", from: nodeInfeasible, to: nodeInfeasible},
		{name: "ours: controller resize started", from: none, to: controllerProgress},
		{name: "ours: controller resize infeasible", from: controllerProgress, to: controllerInfeasble},
		{name: "ours: handed to the node", from: controllerProgress, to: nodePending},
		{name: "ours or the kubelet's: finished", from: nodeProgress, to: none},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, testdriver.Config{})
			_, c := newExpansionFixtureWith(t, f, expansionOpts{})
			old, _ := boundPair("claim", "vol", "2Gi", "1Gi")
			old.ResourceVersion = "1"
			set := func(pvc *v1.PersistentVolumeClaim, s v1.ClaimResourceStatus) {
				if s != none {
					pvc.Status.AllocatedResourceStatuses = map[v1.ResourceName]v1.ClaimResourceStatus{v1.ResourceStorage: s}
				}
			}
			set(old, tc.from)
			updated := old.DeepCopy()
			updated.ResourceVersion = "2"
			updated.Status.AllocatedResourceStatuses = nil
			set(updated, tc.to)
			c.claimUpdated(old, updated)
			if got := c.queue.Len() == 1; got != tc.want {
				t.Errorf("enqueued %v, want %v", got, tc.want)
			}
		})
	}
}
