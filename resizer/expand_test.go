package resizer

import (
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8stesting "k8s.io/client-go/testing"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

type expansionOpts struct {
	trivial     bool
	handleInUse bool
	retryStart  time.Duration // default 1ms
}

// A PVC asking for more gets ControllerExpandVolume and every field upstream records.
func TestExpansionSucceeds(t *testing.T) {
	for _, tc := range []struct {
		name          string
		nodeExpansion bool
	}{
		{name: "controller only"},
		{name: "node expansion required", nodeExpansion: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, c, id := growingClaim(t, testdriver.Config{NodeExpansionRequired: tc.nodeExpansion}, "2Gi")

			if err := c.sync("ns/claim"); err != nil {
				t.Fatalf("sync: %v", err)
			}
			calls := f.calls(testdriver.MethodControllerExpandVolume)
			if len(calls) != 1 || calls[0].VolumeID != id || calls[0].Code != "OK" {
				t.Fatalf("driver calls %+v, want one OK ControllerExpandVolume of %s", calls, id)
			}
			if v, _ := f.driver.Volume(id); v.CapacityBytes != gi(2) {
				t.Errorf("backend volume has %d bytes, want 2Gi", v.CapacityBytes)
			}
			gotPV, gotPVC := f.pv("pv-claim"), f.pvc("claim")
			if c := gotPV.Spec.Capacity[v1.ResourceStorage]; c.Cmp(resource.MustParse("2Gi")) != 0 {
				t.Errorf("PV capacity %s, want 2Gi", c.String())
			}
			if a := gotPVC.Status.AllocatedResources[v1.ResourceStorage]; a.Cmp(resource.MustParse("2Gi")) != 0 {
				t.Errorf("allocatedResources %s, want 2Gi", a.String())
			}
			events := f.events()
			if !hasEvent(events, "Normal Resizing") {
				t.Errorf("no Resizing event in %q", events)
			}
			capacity := gotPVC.Status.Capacity[v1.ResourceStorage]
			if tc.nodeExpansion {
				if capacity.Cmp(resource.MustParse("1Gi")) != 0 {
					t.Errorf("PVC capacity %s, want 1Gi until the node expands", capacity.String())
				}
				if s := gotPVC.Status.AllocatedResourceStatuses[v1.ResourceStorage]; s != v1.PersistentVolumeClaimNodeResizePending {
					t.Errorf("resize status %q, want NodeResizePending", s)
				}
				if condition(gotPVC, v1.PersistentVolumeClaimFileSystemResizePending) == nil {
					t.Errorf("no FileSystemResizePending condition: %+v", gotPVC.Status.Conditions)
				}
				if got := gotPV.Annotations[annPreResizeCapacity]; got != "1Gi" {
					t.Errorf("PV pre-resize-capacity %q, want 1Gi", got)
				}
				if _, ok := gotPVC.Annotations[annNodeExpansionNotRequired]; ok {
					t.Errorf("node-expansion-not-required set while node expansion is required")
				}
				if !hasEvent(events, "Normal FileSystemResizeRequired") {
					t.Errorf("no FileSystemResizeRequired event in %q", events)
				}
				return
			}
			if capacity.Cmp(resource.MustParse("2Gi")) != 0 {
				t.Errorf("PVC capacity %s, want 2Gi", capacity.String())
			}
			if gotPVC.Status.AllocatedResourceStatuses != nil || len(gotPVC.Status.Conditions) != 0 {
				t.Errorf("statuses %v conditions %+v, want none after the resize", gotPVC.Status.AllocatedResourceStatuses, gotPVC.Status.Conditions)
			}
			if gotPVC.Annotations[annNodeExpansionNotRequired] != "true" {
				t.Errorf("node-expansion-not-required annotation %q, want true", gotPVC.Annotations[annNodeExpansionNotRequired])
			}
			if _, ok := gotPV.Annotations[annPreResizeCapacity]; ok {
				t.Errorf("pre-resize-capacity set without node expansion")
			}
			if !hasEvent(events, "Normal VolumeResizeSuccessful") {
				t.Errorf("no VolumeResizeSuccessful event in %q", events)
			}
		})
	}
}

// growingClaim is a started expansion fixture of cfg's driver holding claim "claim", bound
// to PersistentVolume "pv-claim" of a 1Gi driver volume, asking for request; it returns
// the volume's ID too.
func growingClaim(t *testing.T, cfg testdriver.Config, request string) (*fixture, *expansionController, string) {
	t.Helper()
	f := newFixture(t, cfg)
	id := f.createVolume("vol", gi(1))
	pvc, pv := boundPair("claim", id, request, "1Gi")
	f, c := newExpansionFixtureWith(t, f, expansionOpts{}, pvc, pv)
	f.start()
	return f, c, id
}

func newExpansionFixtureWith(t *testing.T, f *fixture, o expansionOpts, objs ...runtime.Object) (*fixture, *expansionController) {
	t.Helper()
	f.add(objs...)
	var exp expander = &csiExpander{client: f.controllerClient(), kube: f.kube}
	if o.trivial {
		exp = trivialExpander{}
	}
	if o.retryStart == 0 {
		o.retryStart = time.Millisecond
	}
	c, err := newExpansionController(expansionConfig{
		controllerConfig: controllerConfig{writer: f.w, informers: f.factory, retryStart: o.retryStart, retryMax: time.Minute},
		expander:         exp, handleInUse: o.handleInUse, annotateFs: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.queue.ShutDown)
	return f, c
}

// Each class of gRPC error is recorded as upstream does: infeasible ones let the user
// lower the request, other final ones leave an error condition, uncertain ones leave the
// resize in progress at its allocated size.
func TestExpansionErrorClasses(t *testing.T) {
	for _, tc := range []struct {
		code           codes.Code
		wantState      v1.ClaimResourceStatus
		wantCondition  bool
		wantRetryError bool
	}{
		{code: codes.InvalidArgument, wantState: v1.PersistentVolumeClaimControllerResizeInfeasible, wantCondition: true},
		{code: codes.OutOfRange, wantState: v1.PersistentVolumeClaimControllerResizeInfeasible, wantCondition: true},
		{code: codes.NotFound, wantState: v1.PersistentVolumeClaimControllerResizeInfeasible, wantCondition: true},
		{code: codes.Internal, wantState: v1.PersistentVolumeClaimControllerResizeInProgress, wantCondition: true, wantRetryError: true},
		{code: codes.FailedPrecondition, wantState: v1.PersistentVolumeClaimControllerResizeInProgress, wantCondition: true, wantRetryError: true},
		{code: codes.DeadlineExceeded, wantState: v1.PersistentVolumeClaimControllerResizeInProgress, wantRetryError: true},
		{code: codes.Unavailable, wantState: v1.PersistentVolumeClaimControllerResizeInProgress, wantRetryError: true},
		{code: codes.ResourceExhausted, wantState: v1.PersistentVolumeClaimControllerResizeInProgress, wantRetryError: true},
		{code: codes.Aborted, wantState: v1.PersistentVolumeClaimControllerResizeInProgress, wantRetryError: true},
	} {
		t.Run(tc.code.String(), func(t *testing.T) {
			f, c, _ := growingClaim(t, testdriver.Config{}, "2Gi")
			if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerExpandVolume, Code: tc.code}); err != nil {
				t.Fatal(err)
			}

			err := c.sync("ns/claim")
			if (err != nil) != tc.wantRetryError {
				t.Errorf("sync error %v, want a retry error: %v", err, tc.wantRetryError)
			}
			got := f.pvc("claim")
			if s := got.Status.AllocatedResourceStatuses[v1.ResourceStorage]; s != tc.wantState {
				t.Errorf("resize status %q, want %q", s, tc.wantState)
			}
			if a := got.Status.AllocatedResources[v1.ResourceStorage]; a.Cmp(resource.MustParse("2Gi")) != 0 {
				t.Errorf("allocatedResources %s, want 2Gi recorded before the call", a.String())
			}
			if (condition(got, v1.PersistentVolumeClaimControllerResizeError) != nil) != tc.wantCondition {
				t.Errorf("ControllerResizeError condition present: %v, want %v (%+v)", !tc.wantCondition, tc.wantCondition, got.Status.Conditions)
			}
			if c := f.pv("pv-claim").Spec.Capacity[v1.ResourceStorage]; c.Cmp(resource.MustParse("1Gi")) != 0 {
				t.Errorf("PV capacity %s changed by a failed expansion", c.String())
			}
			if !hasEvent(f.events(), "Warning VolumeResizeFailed") {
				t.Errorf("no VolumeResizeFailed event")
			}

			// The same failure again records nothing new: no write at all.
			f.settle()
			f.writes()
			_ = c.sync("ns/claim")
			if tc.wantState == v1.PersistentVolumeClaimControllerResizeInfeasible {
				if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 1 {
					t.Errorf("infeasible size retried at once: %d calls", n)
				}
				return
			}
			if n := f.writes(); n != 0 {
				t.Errorf("a repeated failure sent %d writes, want 0", n)
			}
		})
	}
}

// RecoverVolumeExpansionFailure: after an infeasible request the user lowers it (still
// above the old capacity) and the lower size is expanded and recorded.
func TestExpansionRecoversWithLoweredRequest(t *testing.T) {
	f, c, id := growingClaim(t, testdriver.Config{}, "100Gi")
	if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerExpandVolume, Code: codes.OutOfRange, Times: 1}); err != nil {
		t.Fatal(err)
	}
	if err := c.sync("ns/claim"); err != nil {
		t.Fatalf("infeasible sync returned %v, want nil (slow retry)", err)
	}
	f.settle()
	lowered := f.pvc("claim")
	lowered.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse("3Gi")
	f.updateClaim(lowered)

	if err := c.sync("ns/claim"); err != nil {
		t.Fatalf("sync after lowering: %v", err)
	}
	calls := f.calls(testdriver.MethodControllerExpandVolume)
	if len(calls) != 2 || calls[1].Code != "OK" {
		t.Fatalf("calls %+v, want a second, successful one", calls)
	}
	if v, _ := f.driver.Volume(id); v.CapacityBytes != gi(3) {
		t.Errorf("backend volume %d bytes, want 3Gi", v.CapacityBytes)
	}
	got := f.pvc("claim")
	capacity, allocated := got.Status.Capacity[v1.ResourceStorage], got.Status.AllocatedResources[v1.ResourceStorage]
	if capacity.Cmp(resource.MustParse("3Gi")) != 0 || allocated.Cmp(resource.MustParse("3Gi")) != 0 {
		t.Errorf("capacity %s allocated %s, want 3Gi and 3Gi", capacity.String(), allocated.String())
	}
	if got.Status.AllocatedResourceStatuses != nil || condition(got, v1.PersistentVolumeClaimControllerResizeError) != nil {
		t.Errorf("failure not cleared: %v %+v", got.Status.AllocatedResourceStatuses, got.Status.Conditions)
	}
}

// After an uncertain error the driver may still be growing to the allocated size: a lowered
// request must not be sent until that attempt is known to have ended.
func TestExpansionKeepsAllocatedSizeAfterUncertainError(t *testing.T) {
	f, c, id := growingClaim(t, testdriver.Config{}, "10Gi")
	if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerExpandVolume, Code: codes.DeadlineExceeded, Times: 1}); err != nil {
		t.Fatal(err)
	}
	if err := c.sync("ns/claim"); err == nil {
		t.Fatal("uncertain error not retried")
	}
	f.settle()
	lowered := f.pvc("claim")
	lowered.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse("3Gi")
	f.updateClaim(lowered)
	if err := c.sync("ns/claim"); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if v, _ := f.driver.Volume(id); v.CapacityBytes != gi(10) {
		t.Errorf("backend volume %d bytes, want the allocated 10Gi", v.CapacityBytes)
	}
}

// A driver that grows volumes only on the node gets no controller call: the PV takes the
// size and the kubelet is told to finish.
func TestTrivialExpansionHandsOffToTheNode(t *testing.T) {
	pvc, pv := boundPair("claim", "vol-x", "2Gi", "1Gi")
	f := newFixture(t, testdriver.Config{})
	f, c := newExpansionFixtureWith(t, f, expansionOpts{trivial: true}, pvc, pv)
	f.start()
	if err := c.sync("ns/claim"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 0 {
		t.Errorf("%d controller calls, want none", n)
	}
	got := f.pvc("claim")
	if s := got.Status.AllocatedResourceStatuses[v1.ResourceStorage]; s != v1.PersistentVolumeClaimNodeResizePending {
		t.Errorf("status %q, want NodeResizePending", s)
	}
	if c := f.pv("pv-claim").Spec.Capacity[v1.ResourceStorage]; c.Cmp(resource.MustParse("2Gi")) != 0 {
		t.Errorf("PV capacity %s, want 2Gi", c.String())
	}
}

// Once the kubelet recorded the new capacity, the PV's pre-resize-capacity annotation goes.
func TestPreResizeAnnotationRemovedWhenNodeCaughtUp(t *testing.T) {
	pvc, pv := boundPair("claim", "vol-x", "2Gi", "2Gi")
	pv.Spec.Capacity[v1.ResourceStorage] = resource.MustParse("2Gi")
	pv.Annotations = map[string]string{annPreResizeCapacity: "1Gi"}
	f := newFixture(t, testdriver.Config{})
	f, c := newExpansionFixtureWith(t, f, expansionOpts{}, pvc, pv)
	f.start()
	if err := c.sync("ns/claim"); err != nil {
		t.Fatal(err)
	}
	if _, ok := f.pv("pv-claim").Annotations[annPreResizeCapacity]; ok {
		t.Errorf("pre-resize-capacity annotation kept")
	}
}

// PVCs that are not this driver's, not bound, or not asking for more are left alone.
func TestExpansionIgnores(t *testing.T) {
	other, otherPV := boundPair("other", "h", "2Gi", "1Gi")
	otherPV.Spec.CSI.Driver = "someone.else"
	pending, pendingPV := boundPair("pending", "h", "2Gi", "1Gi")
	pending.Status.Phase = v1.ClaimPending
	same, samePV := boundPair("same", "h", "1Gi", "1Gi")
	stolen, stolenPV := boundPair("stolen", "h", "2Gi", "1Gi")
	stolenPV.Spec.ClaimRef.UID = "another-claim"
	f := newFixture(t, testdriver.Config{})
	f, c := newExpansionFixtureWith(t, f, expansionOpts{}, other, otherPV, pending, pendingPV, same, samePV, stolen, stolenPV)
	f.start()
	f.writes()
	for _, key := range []string{"ns/other", "ns/pending", "ns/same", "ns/stolen", "ns/missing"} {
		if err := c.sync(key); err != nil {
			t.Errorf("%s: %v", key, err)
		}
	}
	if n := f.writes(); n != 0 {
		t.Errorf("%d writes, want none", n)
	}
	if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 0 {
		t.Errorf("%d driver calls, want none", n)
	}
}

// The controller-expand secret named on the PV is read and a missing one stops the call.
func TestExpansionSecrets(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	id := f.createVolume("vol", gi(1))
	pvc, pv := boundPair("claim", id, "2Gi", "1Gi")
	pv.Spec.CSI.ControllerExpandSecretRef = &v1.SecretReference{Namespace: "secrets", Name: "expand"}
	f, c := newExpansionFixtureWith(t, f, expansionOpts{}, pvc, pv)
	f.start()
	if err := c.sync("ns/claim"); err == nil {
		t.Fatal("missing secret: want an error")
	}
	if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 0 {
		t.Fatalf("driver called without its secret")
	}
	secret := &v1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "secrets", Name: "expand"}, Data: map[string][]byte{"password": []byte("x")}}
	if err := f.kube.Tracker().Add(secret); err != nil {
		t.Fatal(err)
	}
	f.settle()
	if err := c.sync("ns/claim"); err != nil {
		t.Fatalf("with the secret: %v", err)
	}
	if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 1 {
		t.Errorf("%d calls, want 1", n)
	}
}

// The volume was expanded but the PVC could not be marked: VolumeResizeFailed with the
// error, as upstream, and no success event. The sync fails, so the PVC is retried.
func TestExpansionRecordingFailureIsAnEvent(t *testing.T) {
	conflict := apierrors.NewConflict(schema.GroupResource{Resource: "persistentvolumeclaims"}, "claim", errors.New("injected"))
	internal := apierrors.NewInternalError(errors.New("injected"))
	for _, tc := range []struct {
		name          string
		nodeExpansion bool
		err           error
		wantEvent     string // "" for none
	}{
		{name: "finished, write fails", err: internal, wantEvent: `Warning VolumeResizeFailed mark PVC "ns/claim" as resize finished failed`},
		{name: "node expansion required, write fails", nodeExpansion: true, err: internal, wantEvent: `Warning VolumeResizeFailed mark PVC "ns/claim" as node expansion required failed`},
		{name: "conflict", err: conflict, wantEvent: `Warning VolumeResizeFailed mark PVC "ns/claim" as resize finished failed`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, testdriver.Config{NodeExpansionRequired: tc.nodeExpansion})
			id := f.createVolume("vol", gi(1))
			pvc, pv := boundPair("claim", id, "2Gi", "1Gi")
			f, c := newExpansionFixtureWith(t, f, expansionOpts{}, pvc, pv)
			f.start()
			// Every PVC write after the driver expanded the volume fails.
			f.kube.PrependReactor("patch", "persistentvolumeclaims", func(k8stesting.Action) (bool, runtime.Object, error) {
				if len(f.calls(testdriver.MethodControllerExpandVolume)) > 0 {
					return true, nil, tc.err
				}
				return false, nil, nil
			})

			if err := c.sync("ns/claim"); err == nil {
				t.Error("sync returned nil, want the write's error (retry)")
			}
			if n := len(f.calls(testdriver.MethodControllerExpandVolume)); n != 1 {
				t.Fatalf("%d ControllerExpandVolume calls, want 1", n)
			}
			events := f.events()
			var failed []string
			for _, e := range events {
				if strings.HasPrefix(e, "Warning VolumeResizeFailed") {
					failed = append(failed, e)
				}
			}
			switch {
			case tc.wantEvent == "" && len(failed) != 0:
				t.Errorf("events %q, want no VolumeResizeFailed", events)
			case tc.wantEvent != "" && (len(failed) != 1 || !strings.HasPrefix(failed[0], tc.wantEvent)):
				t.Errorf("events %q, want one starting %q", events, tc.wantEvent)
			}
			if hasEvent(events, "Normal VolumeResizeSuccessful") || hasEvent(events, "Normal FileSystemResizeRequired") {
				t.Errorf("events %q: success recorded although the PVC was not marked", events)
			}
		})
	}
}
