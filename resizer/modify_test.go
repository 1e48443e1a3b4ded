package resizer

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func class(name, iops string) *storagev1.VolumeAttributesClass {
	return &storagev1.VolumeAttributesClass{ObjectMeta: metav1.ObjectMeta{Name: name}, DriverName: testDriver, Parameters: map[string]string{"iops": iops}}
}

// modifyPair is a bound pair whose volume has class current and whose PVC asks for target.
func (f *fixture) modifyPair(current, target string) (*v1.PersistentVolumeClaim, *v1.PersistentVolume, string) {
	id := f.createVolume("vol", gi(1))
	pvc, pv := boundPair("claim", id, "1Gi", "1Gi")
	pvc.Spec.VolumeAttributesClassName = ptr.To(target)
	pvc.Status.CurrentVolumeAttributesClassName = ptr.To(current)
	pv.Spec.VolumeAttributesClassName = ptr.To(current)
	return pvc, pv, id
}

func newModifyFixtureWith(t *testing.T, f *fixture, extra bool, objs ...runtime.Object) *modifyController {
	t.Helper()
	return newModifyFixtureRetry(t, f, extra, time.Millisecond, objs...)
}

// newModifyFixtureRetry is newModifyFixtureWith with the backoff's first step retryStart.
func newModifyFixtureRetry(t *testing.T, f *fixture, extra bool, retryStart time.Duration, objs ...runtime.Object) *modifyController {
	t.Helper()
	f.add(objs...)
	c, err := newModifyController(modifyConfig{
		controllerConfig: controllerConfig{writer: f.w, informers: f.factory, retryStart: retryStart, retryMax: time.Minute},
		modifier:         &modifier{client: f.controllerClient(), kube: f.kube}, extraMetadata: extra,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.queue.ShutDown)
	f.start()
	return c
}

// A changed class is applied with its parameters and recorded on the PVC and the PV.
func TestModifySucceeds(t *testing.T) {
	for _, extra := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "extra metadata"}[extra], func(t *testing.T) {
			f := newFixture(t, testdriver.Config{MutableParameters: []string{"iops", paramPVCName, paramPVCNamespace, paramPVName}})
			pvc, pv, id := f.modifyPair("silver", "gold")
			c := newModifyFixtureWith(t, f, extra, pvc, pv, class("silver", "100"), class("gold", "500"))
			if err := c.sync("ns/claim"); err != nil {
				t.Fatal(err)
			}
			vol, _ := f.driver.Volume(id)
			if vol.MutableParameters["iops"] != "500" {
				t.Errorf("backend parameters %v, want iops=500", vol.MutableParameters)
			}
			if got := vol.MutableParameters[paramPVCName] == "claim"; got != extra {
				t.Errorf("extra metadata passed: %v, want %v (%v)", got, extra, vol.MutableParameters)
			}
			got := f.pvc("claim")
			if ptr.Deref(got.Status.CurrentVolumeAttributesClassName, "") != "gold" || got.Status.ModifyVolumeStatus != nil || len(got.Status.Conditions) != 0 {
				t.Errorf("PVC status %+v, want current gold and nothing pending", got.Status)
			}
			if ptr.Deref(f.pv("pv-claim").Spec.VolumeAttributesClassName, "") != "gold" {
				t.Errorf("PV class not gold")
			}
			events := f.events()
			if !hasEvent(events, "Normal VolumeModify ") || !hasEvent(events, "Normal VolumeModifySuccessful") {
				t.Errorf("events %q", events)
			}
		})
	}
}

// A class that does not exist leaves the PVC Pending without a call; creating the class
// enqueues the PVC at once.
func TestModifyPendingUntilTheClassExists(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	pvc, pv, _ := f.modifyPair("silver", "gold")
	c := newModifyFixtureWith(t, f, false, pvc, pv, class("silver", "100"))
	if err := c.sync("ns/claim"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.calls(testdriver.MethodControllerModifyVolume)); n != 0 {
		t.Fatalf("%d calls for a missing class", n)
	}
	got := f.pvc("claim")
	if s := got.Status.ModifyVolumeStatus; s == nil || s.Status != v1.PersistentVolumeClaimModifyVolumePending || s.TargetVolumeAttributesClassName != "gold" {
		t.Fatalf("modify status %+v, want Pending gold", s)
	}
	f.settle()
	for c.queue.Len() > 0 {
		k, _ := c.queue.Get()
		c.queue.Done(k)
	}
	if _, err := f.kube.StorageV1().VolumeAttributesClasses().Create(context.Background(), class("gold", "500"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(context.Background(), 5e6, 5e9, true, func(context.Context) (bool, error) {
		_, err := c.vacs.Get("gold")
		return err == nil && c.queue.Len() > 0, nil
	}); err != nil {
		t.Fatal("creating the class did not enqueue the PVC")
	}
	if err := c.sync("ns/claim"); err != nil {
		t.Fatal(err)
	}
	if ptr.Deref(f.pvc("claim").Status.CurrentVolumeAttributesClassName, "") != "gold" {
		t.Errorf("not modified once the class exists: %+v %+v", f.pvc("claim").Status, f.calls(testdriver.MethodControllerModifyVolume))
	}
}

// InvalidArgument is Infeasible; rolling back to the current class then applies that class
// through the driver again, as upstream: a refused call may still have changed the volume.
func TestModifyInfeasibleThenRollback(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	pvc, pv, id := f.modifyPair("silver", "gold")
	c := newModifyFixtureWith(t, f, false, pvc, pv, class("silver", "100"), class("gold", "500"))
	if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerModifyVolume, Code: codes.InvalidArgument, Times: 1}); err != nil {
		t.Fatal(err)
	}
	if err := c.sync("ns/claim"); err != nil {
		t.Fatalf("infeasible returned %v, want nil (slow retry)", err)
	}
	got := f.pvc("claim")
	if s := got.Status.ModifyVolumeStatus; s == nil || s.Status != v1.PersistentVolumeClaimModifyVolumeInfeasible {
		t.Fatalf("modify status %+v, want Infeasible", s)
	}
	if condition(got, v1.PersistentVolumeClaimVolumeModifyVolumeError) == nil {
		t.Errorf("no ModifyVolumeError condition: %+v", got.Status.Conditions)
	}
	if !hasEvent(f.events(), "Warning VolumeModifyFailed") {
		t.Errorf("no VolumeModifyFailed event")
	}
	f.settle()
	got.Spec.VolumeAttributesClassName = ptr.To("silver")
	f.updateClaim(got)
	if err := c.sync("ns/claim"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.calls(testdriver.MethodControllerModifyVolume)); n != 2 {
		t.Errorf("%d calls, want 2: the refused gold and silver again", n)
	}
	if vol, _ := f.driver.Volume(id); vol.MutableParameters["iops"] != "100" {
		t.Errorf("backend iops %q, want 100", vol.MutableParameters["iops"])
	}
	got = f.pvc("claim")
	if got.Status.ModifyVolumeStatus != nil || len(got.Status.Conditions) != 0 || ptr.Deref(got.Status.CurrentVolumeAttributesClassName, "") != "silver" {
		t.Errorf("after rollback: %+v", got.Status)
	}
	if events := f.events(); !hasEvent(events, "Normal VolumeModify external resizer is modifying volume claim with vac silver") || !hasEvent(events, "Normal VolumeModifySuccessful") {
		t.Errorf("rollback events %q, want VolumeModify and VolumeModifySuccessful", events)
	}
}

// After an uncertain error the driver may still apply the new class: a rollback first
// finishes that class, then applies the current one again. Between the two, the PVC and
// the PV record the class the volume then has.
func TestModifyRollbackAfterUncertainErrorFinishesTheTargetFirst(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	pvc, pv, id := f.modifyPair("silver", "gold")
	c := newModifyFixtureWith(t, f, false, pvc, pv, class("silver", "100"), class("gold", "500"))
	if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerModifyVolume, Code: codes.DeadlineExceeded, Times: 1, ApplyAnyway: true}); err != nil {
		t.Fatal(err)
	}
	if err := c.sync("ns/claim"); err == nil {
		t.Fatal("uncertain error not retried")
	}
	f.settle()
	got := f.pvc("claim")
	if s := got.Status.ModifyVolumeStatus; s == nil || s.Status != v1.PersistentVolumeClaimModifyVolumeInProgress {
		t.Fatalf("status %+v, want InProgress", s)
	}
	got.Spec.VolumeAttributesClassName = ptr.To("silver")
	f.updateClaim(got)
	f.events()
	f.syncExpecting(t, c, id, "500", "gold")
	f.syncExpecting(t, c, id, "100", "silver")
	if n := len(f.calls(testdriver.MethodControllerModifyVolume)); n != 3 {
		t.Errorf("%d calls, want 3: gold cut off, gold finished, silver", n)
	}
}

// syncExpecting syncs ns/claim once and checks that the backend then has iops and the PVC
// and PV record class, with no modification left.
func (f *fixture) syncExpecting(t *testing.T, c *modifyController, id, iops, class string) {
	t.Helper()
	if err := c.sync("ns/claim"); err != nil {
		t.Fatal(err)
	}
	f.settle()
	if vol, _ := f.driver.Volume(id); vol.MutableParameters["iops"] != iops {
		t.Errorf("backend iops %q, want %s (%s)", vol.MutableParameters["iops"], iops, class)
	}
	got := f.pvc("claim")
	if cur := ptr.Deref(got.Status.CurrentVolumeAttributesClassName, ""); cur != class || got.Status.ModifyVolumeStatus != nil {
		t.Errorf("PVC current class %q status %+v, want %s and none", cur, got.Status.ModifyVolumeStatus, class)
	}
	if cur := ptr.Deref(f.pv("pv-claim").Spec.VolumeAttributesClassName, ""); cur != class {
		t.Errorf("PV class %q, want %s", cur, class)
	}
}

// A modification a previous leader left InProgress may still run in the driver: a new
// leader, with no record of it, finishes its class (without announcing a new attempt)
// before it applies what the PVC asks for now, a rollback or another class.
func TestModifyInProgressAtStartIsFinishedFirst(t *testing.T) {
	for _, tc := range []struct {
		name      string
		spec      string
		wantIOPS  string
		wantClass string
	}{
		{name: "rollback to the current class", spec: "silver", wantIOPS: "100", wantClass: "silver"},
		{name: "another class", spec: "platinum", wantIOPS: "900", wantClass: "platinum"},
		{name: "the same class", spec: "gold", wantIOPS: "500", wantClass: "gold"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, testdriver.Config{})
			pvc, pv, id := f.modifyPair("silver", tc.spec)
			pvc.Status.ModifyVolumeStatus = &v1.ModifyVolumeStatus{TargetVolumeAttributesClassName: "gold", Status: v1.PersistentVolumeClaimModifyVolumeInProgress}
			pvc.Status.Conditions = []v1.PersistentVolumeClaimCondition{{Type: v1.PersistentVolumeClaimVolumeModifyingVolume, Status: v1.ConditionTrue}}
			c := newModifyFixtureWith(t, f, false, pvc, pv, class("silver", "100"), class("gold", "500"), class("platinum", "900"))
			f.syncExpecting(t, c, id, "500", "gold")
			events := f.events()
			if hasEvent(events, "Normal VolumeModify ") || !hasEvent(events, "Normal VolumeModifySuccessful external resizer modified volume claim with vac gold") {
				t.Errorf("events %q, want only gold's VolumeModifySuccessful", events)
			}
			f.syncExpecting(t, c, id, tc.wantIOPS, tc.wantClass)
		})
	}
}

// A modification whose last call ended with a final error certainly does not run any more:
// a new class is applied at once.
func TestModifyAfterFinalErrorTakesTheNewClass(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	pvc, pv, id := f.modifyPair("silver", "gold")
	c := newModifyFixtureWith(t, f, false, pvc, pv, class("silver", "100"), class("gold", "500"), class("platinum", "900"))
	if err := f.driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerModifyVolume, Code: codes.Internal, Times: 1}); err != nil {
		t.Fatal(err)
	}
	if err := c.sync("ns/claim"); err == nil {
		t.Fatal("final error not retried")
	}
	f.settle()
	got := f.pvc("claim")
	if s := got.Status.ModifyVolumeStatus; s == nil || s.Status != v1.PersistentVolumeClaimModifyVolumeInProgress {
		t.Fatalf("status %+v, want InProgress", s)
	}
	got.Spec.VolumeAttributesClassName = ptr.To("platinum")
	f.updateClaim(got)
	f.syncExpecting(t, c, id, "900", "platinum")
	if n := len(f.calls(testdriver.MethodControllerModifyVolume)); n != 2 {
		t.Errorf("%d calls, want 2: the failed gold and platinum", n)
	}
}

// planModify's decisions, upstream's modify: what a sync does for each PVC state.
func TestPlanModify(t *testing.T) {
	state := func(s v1.PersistentVolumeClaimModifyVolumeStatus, target string) *v1.ModifyVolumeStatus {
		return &v1.ModifyVolumeStatus{TargetVolumeAttributesClassName: target, Status: s}
	}
	inProgress, infeasible, pending := v1.PersistentVolumeClaimModifyVolumeInProgress, v1.PersistentVolumeClaimModifyVolumeInfeasible, v1.PersistentVolumeClaimModifyVolumePending
	modifying := []v1.PersistentVolumeClaimCondition{{Type: v1.PersistentVolumeClaimVolumeModifyingVolume, Status: v1.ConditionTrue}}
	for _, tc := range []struct {
		name          string
		spec, current string // "" is nil
		status        *v1.ModifyVolumeStatus
		conditions    []v1.PersistentVolumeClaimCondition
		inDoubt       bool
		wantAction    modifyAction
		wantClass     string
	}{
		{name: "no class", wantAction: modifyNothing},
		{name: "has its class", spec: "gold", current: "gold", wantAction: modifyNothing},
		{name: "has its class, no record (new leader)", spec: "gold", current: "gold", inDoubt: true, wantAction: modifyNothing},
		{name: "new class", spec: "gold", current: "silver", wantAction: modifyStart, wantClass: "gold"},
		{name: "first class", spec: "gold", wantAction: modifyStart, wantClass: "gold"},
		{name: "pending class", spec: "gold", current: "silver", status: state(pending, "gold"), inDoubt: true, wantAction: modifyStart, wantClass: "gold"},
		{name: "infeasible, retried", spec: "gold", current: "silver", status: state(infeasible, "gold"), wantAction: modifyStart, wantClass: "gold"},
		{name: "infeasible, other class", spec: "platinum", current: "silver", status: state(infeasible, "gold"), inDoubt: true, wantAction: modifyStart, wantClass: "platinum"},
		{name: "infeasible, rolled back: applied again", spec: "silver", current: "silver", status: state(infeasible, "gold"), wantAction: modifyStart, wantClass: "silver"},
		{name: "in progress after a final error, retried", spec: "gold", current: "silver", status: state(inProgress, "gold"), wantAction: modifyStart, wantClass: "gold"},
		{name: "in progress after a final error, other class", spec: "platinum", current: "silver", status: state(inProgress, "gold"), wantAction: modifyStart, wantClass: "platinum"},
		{name: "in progress after a final error, rolled back: applied again", spec: "silver", current: "silver", status: state(inProgress, "gold"), wantAction: modifyStart, wantClass: "silver"},
		{name: "in progress in doubt: finished", spec: "gold", current: "silver", status: state(inProgress, "gold"), inDoubt: true, wantAction: modifyResume, wantClass: "gold"},
		{name: "in progress in doubt, other class: finished first", spec: "platinum", current: "silver", status: state(inProgress, "gold"), inDoubt: true, wantAction: modifyResume, wantClass: "gold"},
		{name: "in progress in doubt, rolled back: finished first", spec: "silver", current: "silver", status: state(inProgress, "gold"), inDoubt: true, wantAction: modifyResume, wantClass: "gold"},
		{name: "in progress, class cleared: carried on", status: state(inProgress, "gold"), conditions: modifying, wantAction: modifyResume, wantClass: "gold"},
		{name: "in progress in doubt, class cleared: carried on", status: state(inProgress, "gold"), conditions: modifying, inDoubt: true, wantAction: modifyResume, wantClass: "gold"},
		{name: "infeasible, class cleared: cancelled", status: state(infeasible, "gold"), conditions: modifying, wantAction: modifyCancel},
		{name: "pending, class cleared: cancelled", status: state(pending, "gold"), conditions: modifying, wantAction: modifyCancel},
		{name: "cancelled already", status: state(infeasible, "gold"), wantAction: modifyNothing},
		{name: "in progress without a target, class cleared", status: state(inProgress, ""), wantAction: modifyNothing},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pvc := &v1.PersistentVolumeClaim{}
			if tc.spec != "" {
				pvc.Spec.VolumeAttributesClassName = ptr.To(tc.spec)
			}
			if tc.current != "" {
				pvc.Status.CurrentVolumeAttributesClassName = ptr.To(tc.current)
			}
			pvc.Status.ModifyVolumeStatus = tc.status
			pvc.Status.Conditions = tc.conditions
			got := planModify(pvc, tc.inDoubt)
			if got.action != tc.wantAction || got.class != tc.wantClass {
				t.Errorf("plan %+v, want action %d class %q", got, tc.wantAction, tc.wantClass)
			}
		})
	}
}

// The status a modification records, as upstream's markControllerModifyVolumeStatus: the
// ModifyingVolume condition's message, the ModifyVolumeError condition's reason (the gRPC
// code) and message, lastProbeTime now, lastTransitionTime kept while status and reason
// stay, and Infeasible only for InvalidArgument.
func TestModifyStatusConditions(t *testing.T) {
	earlier, now := metav1.NewTime(time.Unix(1000, 0)), metav1.NewTime(time.Unix(2000, 0))
	old := func(typ v1.PersistentVolumeClaimConditionType, reason string) v1.PersistentVolumeClaimCondition {
		return v1.PersistentVolumeClaimCondition{Type: typ, Status: v1.ConditionTrue, Reason: reason, Message: "old", LastProbeTime: earlier, LastTransitionTime: earlier}
	}
	resizing := v1.PersistentVolumeClaimCondition{Type: v1.PersistentVolumeClaimResizing, Status: v1.ConditionTrue, LastTransitionTime: earlier}
	const modifying, modifyError = v1.PersistentVolumeClaimVolumeModifyingVolume, v1.PersistentVolumeClaimVolumeModifyVolumeError
	type cond struct {
		reason, message string
		transition      metav1.Time
	}
	for _, tc := range []struct {
		name      string
		before    []v1.PersistentVolumeClaimCondition
		err       error // nil: marked in progress
		wantState v1.PersistentVolumeClaimModifyVolumeStatus
		want      map[v1.PersistentVolumeClaimConditionType]cond
	}{
		{
			name: "in progress", before: []v1.PersistentVolumeClaimCondition{resizing},
			wantState: v1.PersistentVolumeClaimModifyVolumeInProgress,
			want:      map[v1.PersistentVolumeClaimConditionType]cond{modifying: {message: `Modifying volume to "gold" is in progress.`, transition: now}},
		},
		{
			name: "in progress again: transition kept, the last error too", before: []v1.PersistentVolumeClaimCondition{old(modifying, ""), old(modifyError, "Internal"), resizing},
			wantState: v1.PersistentVolumeClaimModifyVolumeInProgress,
			want: map[v1.PersistentVolumeClaimConditionType]cond{
				modifying:   {message: `Modifying volume to "gold" is in progress.`, transition: earlier},
				modifyError: {reason: "Internal", message: "old", transition: earlier},
			},
		},
		{
			name: "final error", before: []v1.PersistentVolumeClaimCondition{old(modifying, ""), resizing},
			err:       status.Error(codes.Internal, "broken"),
			wantState: v1.PersistentVolumeClaimModifyVolumeInProgress,
			want: map[v1.PersistentVolumeClaimConditionType]cond{
				modifying:   {message: `Modifying volume to "gold" failed. Waiting for retry.`, transition: earlier},
				modifyError: {reason: "Internal", message: "broken", transition: now},
			},
		},
		{
			name: "uncertain error", before: []v1.PersistentVolumeClaimCondition{old(modifying, "")},
			err:       status.Error(codes.DeadlineExceeded, "too slow"),
			wantState: v1.PersistentVolumeClaimModifyVolumeInProgress,
			want: map[v1.PersistentVolumeClaimConditionType]cond{
				modifying:   {message: `Modifying volume to "gold" is still in progress.`, transition: earlier},
				modifyError: {reason: "DeadlineExceeded", message: "too slow", transition: now},
			},
		},
		{
			name: "infeasible", before: []v1.PersistentVolumeClaimCondition{old(modifying, "")},
			err:       status.Error(codes.InvalidArgument, "no such parameter"),
			wantState: v1.PersistentVolumeClaimModifyVolumeInfeasible,
			want: map[v1.PersistentVolumeClaimConditionType]cond{
				modifying:   {message: `Modifying volume to "gold" failed. Waiting for retry.`, transition: earlier},
				modifyError: {reason: "InvalidArgument", message: "no such parameter", transition: now},
			},
		},
		{
			name: "same error again: transition kept", before: []v1.PersistentVolumeClaimCondition{old(modifying, ""), old(modifyError, "Internal")},
			err:       status.Error(codes.Internal, "broken"),
			wantState: v1.PersistentVolumeClaimModifyVolumeInProgress,
			want: map[v1.PersistentVolumeClaimConditionType]cond{
				modifying:   {message: `Modifying volume to "gold" failed. Waiting for retry.`, transition: earlier},
				modifyError: {reason: "Internal", message: "broken", transition: earlier},
			},
		},
		{
			name: "other error: new transition", before: []v1.PersistentVolumeClaimCondition{old(modifying, ""), old(modifyError, "Internal")},
			err:       status.Error(codes.Unavailable, "gone"),
			wantState: v1.PersistentVolumeClaimModifyVolumeInProgress,
			want: map[v1.PersistentVolumeClaimConditionType]cond{
				modifying:   {message: `Modifying volume to "gold" is still in progress.`, transition: earlier},
				modifyError: {reason: "Unavailable", message: "gone", transition: now},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pvc := &v1.PersistentVolumeClaim{}
			pvc.Status.Conditions = tc.before
			var got *v1.PersistentVolumeClaim
			if tc.err == nil {
				got = markModifyInProgress(pvc, "gold", now)
			} else {
				got = markModifyFailed(pvc, "gold", tc.err, now)
			}
			if s := got.Status.ModifyVolumeStatus; s == nil || s.Status != tc.wantState || s.TargetVolumeAttributesClassName != "gold" {
				t.Errorf("modify status %+v, want %s gold", s, tc.wantState)
			}
			if c := condition(got, v1.PersistentVolumeClaimResizing); (c != nil) != slices.Contains(tc.before, resizing) || (c != nil && *c != resizing) {
				t.Errorf("other condition changed: %+v", got.Status.Conditions)
			}
			for typ, want := range tc.want {
				c := condition(got, typ)
				if c == nil {
					t.Errorf("no %s condition", typ)
					continue
				}
				if c.Status != v1.ConditionTrue || c.Reason != want.reason || c.Message != want.message || !c.LastTransitionTime.Equal(&want.transition) {
					t.Errorf("%s: %+v, want reason %q message %q transition %v", typ, *c, want.reason, want.message, want.transition)
				}
				wantProbe := now
				if tc.err == nil && typ == modifyError {
					wantProbe = earlier // not probed by marking in progress
				}
				if !c.LastProbeTime.Equal(&wantProbe) {
					t.Errorf("%s probed %v, want %v", typ, c.LastProbeTime, wantProbe)
				}
			}
			if n := len(got.Status.Conditions); n != len(tc.want)+count(tc.before, resizing) {
				t.Errorf("conditions %+v, want %d", got.Status.Conditions, len(tc.want))
			}
		})
	}
}

func count[T comparable](s []T, v T) int {
	n := 0
	for _, x := range s {
		if x == v {
			n++
		}
	}
	return n
}

// The modify controller's events, reason and message as upstream records them, sync by
// sync: what each sync records, in order ("Type Reason Message" prefixes).
func TestModifyEvents(t *testing.T) {
	modifyingConditions := []v1.PersistentVolumeClaimCondition{
		{Type: v1.PersistentVolumeClaimVolumeModifyingVolume, Status: v1.ConditionTrue},
		{Type: v1.PersistentVolumeClaimVolumeModifyVolumeError, Status: v1.ConditionTrue, Message: "refused"},
	}
	withdrawn := func(status v1.PersistentVolumeClaimModifyVolumeStatus) func(*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
		return func(pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) {
			pvc.Spec.VolumeAttributesClassName = nil
			pvc.Status.CurrentVolumeAttributesClassName = nil
			pv.Spec.VolumeAttributesClassName = nil
			pvc.Status.ModifyVolumeStatus = &v1.ModifyVolumeStatus{TargetVolumeAttributesClassName: "gold", Status: status}
			pvc.Status.Conditions = slices.Clone(modifyingConditions)
		}
	}
	const fault = "injected " + testdriver.MethodControllerModifyVolume + " fault"
	for _, tc := range []struct {
		name       string
		mutate     func(*v1.PersistentVolumeClaim, *v1.PersistentVolume)
		noGold     bool
		fault      *testdriver.Fault
		failWrites bool // every PVC write after the driver call fails
		want       [][]string
		check      func(t *testing.T, pvc *v1.PersistentVolumeClaim)
	}{
		{
			name:   "class does not exist: quoted, as upstream",
			noGold: true,
			want:   [][]string{{`Warning VolumeModifyFailed VAC "gold" does not exist.`}},
		},
		{
			name: "succeeds",
			want: [][]string{{"Normal VolumeModify external resizer is modifying volume claim with vac gold", "Normal VolumeModifySuccessful external resizer modified volume claim with vac gold successfully"}},
		},
		{
			name:  "final error, then the retry is announced again",
			fault: &testdriver.Fault{Method: testdriver.MethodControllerModifyVolume, Code: codes.Internal, Times: 1},
			want: [][]string{
				{"Normal VolumeModify ", "Warning VolumeModifyFailed rpc error: code = Internal desc = " + fault},
				{"Normal VolumeModify ", "Normal VolumeModifySuccessful "},
			},
		},
		{
			name:  "uncertain error says it is still modifying; its continuation is not announced",
			fault: &testdriver.Fault{Method: testdriver.MethodControllerModifyVolume, Code: codes.DeadlineExceeded, Times: 1},
			want: [][]string{
				{"Normal VolumeModify ", "Warning VolumeModifyFailed rpc error: code = DeadlineExceeded desc = " + fault + ". Still modifying to VAC gold"},
				{"Normal VolumeModifySuccessful "},
			},
		},
		{
			name:       "no failure event when the failure could not be recorded",
			fault:      &testdriver.Fault{Method: testdriver.MethodControllerModifyVolume, Code: codes.Internal},
			failWrites: true,
			want:       [][]string{{"Normal VolumeModify "}},
		},
		{
			name: "failure before the driver call (missing secret): an event, unlike upstream",
			mutate: func(_ *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) {
				pv.Spec.CSI.ControllerExpandSecretRef = &v1.SecretReference{Namespace: "ns", Name: "missing"}
			},
			want: [][]string{{"Normal VolumeModify ", "Warning VolumeModifyFailed reading the controller-expand secret ns/missing"}},
		},
		{
			name:   "withdrawn after it failed: cancelled",
			mutate: withdrawn(v1.PersistentVolumeClaimModifyVolumeInfeasible),
			want:   [][]string{{"Normal VolumeModifyCanceled Cancelled modify."}},
			check: func(t *testing.T, pvc *v1.PersistentVolumeClaim) {
				if condition(pvc, v1.PersistentVolumeClaimVolumeModifyingVolume) != nil || condition(pvc, v1.PersistentVolumeClaimVolumeModifyVolumeError) == nil {
					t.Errorf("conditions %+v, want only ModifyingVolume dropped", pvc.Status.Conditions)
				}
				if s := pvc.Status.ModifyVolumeStatus; s == nil || s.Status != v1.PersistentVolumeClaimModifyVolumeInfeasible {
					t.Errorf("modify status %+v, want the last outcome kept", s)
				}
			},
		},
		{
			name:   "withdrawn while InProgress: carried on to its class, not announced again",
			mutate: withdrawn(v1.PersistentVolumeClaimModifyVolumeInProgress),
			want:   [][]string{{"Normal VolumeModifySuccessful external resizer modified volume claim with vac gold successfully"}},
			check: func(t *testing.T, pvc *v1.PersistentVolumeClaim) {
				if len(pvc.Status.Conditions) != 0 || pvc.Status.ModifyVolumeStatus != nil || ptr.Deref(pvc.Status.CurrentVolumeAttributesClassName, "") != "gold" {
					t.Errorf("status %+v, want gold and nothing pending", pvc.Status)
				}
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, testdriver.Config{})
			pvc, pv, _ := f.modifyPair("silver", "gold")
			if tc.mutate != nil {
				tc.mutate(pvc, pv)
			}
			objs := []runtime.Object{pvc, pv, class("silver", "100")}
			if !tc.noGold {
				objs = append(objs, class("gold", "500"))
			}
			c := newModifyFixtureWith(t, f, false, objs...)
			if tc.fault != nil {
				if err := f.driver.InjectFault(*tc.fault); err != nil {
					t.Fatal(err)
				}
			}
			if tc.failWrites {
				f.kube.PrependReactor("patch", "persistentvolumeclaims", func(k8stesting.Action) (bool, runtime.Object, error) {
					if len(f.calls(testdriver.MethodControllerModifyVolume)) > 0 {
						return true, nil, apierrors.NewInternalError(errors.New("injected"))
					}
					return false, nil, nil
				})
			}
			for i, want := range tc.want {
				_ = c.sync("ns/claim")
				f.settle()
				got := f.events()
				ok := len(got) == len(want)
				for j := 0; ok && j < len(want); j++ {
					ok = strings.HasPrefix(got[j], want[j])
				}
				if !ok {
					t.Errorf("sync %d: events %q, want %q", i+1, got, want)
				}
			}
			if tc.check != nil {
				tc.check(t, f.pvc("claim"))
			}
		})
	}
}

// secretRecorder is the driver's controller client that remembers the secrets each
// ControllerModifyVolume carried (the test driver's journal leaves them out).
type secretRecorder struct {
	csi.ControllerClient
	mu      sync.Mutex
	secrets []map[string]string
}

func (r *secretRecorder) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest, opts ...grpc.CallOption) (*csi.ControllerModifyVolumeResponse, error) {
	r.mu.Lock()
	r.secrets = append(r.secrets, req.GetSecrets())
	r.mu.Unlock()
	return r.ControllerClient.ControllerModifyVolume(ctx, req, opts...)
}

// ControllerModifyVolume gets the secret the PV's controller-modify-secret annotations name
// (both must be set), else the controller-expand secret of its CSI source, as upstream.
func TestModifySecrets(t *testing.T) {
	secret := func(ns, name, value string) *v1.Secret {
		return &v1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Data: map[string][]byte{"key": []byte(value)}}
	}
	both := map[string]string{annModifySecretName: "modify", annModifySecretNamespace: "secrets"}
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		expandRef   bool
		want        map[string]string // nil: no secrets; the call is made unless wantErr
		wantErr     string
	}{
		{name: "none"},
		{name: "expand secret only: it is used", expandRef: true, want: map[string]string{"key": "expand"}},
		{name: "modify annotations: the modify secret", annotations: both, expandRef: true, want: map[string]string{"key": "modify"}},
		{name: "modify annotations without an expand secret", annotations: both, want: map[string]string{"key": "modify"}},
		{name: "name without namespace: the expand secret", annotations: map[string]string{annModifySecretName: "modify"}, expandRef: true, want: map[string]string{"key": "expand"}},
		{name: "namespace without name: no secret", annotations: map[string]string{annModifySecretNamespace: "secrets"}},
		{name: "modify secret missing: no call", annotations: map[string]string{annModifySecretName: "gone", annModifySecretNamespace: "secrets"}, expandRef: true, wantErr: "reading the controller-modify secret secrets/gone"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, testdriver.Config{})
			pvc, pv, _ := f.modifyPair("silver", "gold")
			pv.Annotations = tc.annotations
			if tc.expandRef {
				pv.Spec.CSI.ControllerExpandSecretRef = &v1.SecretReference{Namespace: "secrets", Name: "expand"}
			}
			rec := &secretRecorder{ControllerClient: f.controllerClient()}
			f.add(pvc, pv, class("silver", "100"), class("gold", "500"), secret("secrets", "expand", "expand"), secret("secrets", "modify", "modify"))
			c, err := newModifyController(modifyConfig{
				controllerConfig: controllerConfig{writer: f.w, informers: f.factory, retryStart: time.Millisecond, retryMax: time.Minute},
				modifier:         &modifier{client: rec, kube: f.kube},
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(c.queue.ShutDown)
			f.start()
			err = c.sync("ns/claim")
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("sync: %v, want %q", err, tc.wantErr)
				}
				if n := len(f.calls(testdriver.MethodControllerModifyVolume)); n != 0 {
					t.Errorf("%d ControllerModifyVolume calls without the secret, want none", n)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(rec.secrets) != 1 {
				t.Fatalf("%d ControllerModifyVolume calls, want 1", len(rec.secrets))
			}
			if got := rec.secrets[0]; !maps.Equal(got, tc.want) {
				t.Errorf("secrets %v, want %v", got, tc.want)
			}
		})
	}
}

// A resumed modification whose class was the current one (a rollback cut off, then another
// class asked for) changes no class when it finishes; its end still enqueues the PVC, so the
// class asked for meanwhile is applied without waiting for a resync.
func TestModifyResumedEndEnqueuesTheClassAskedFor(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	pvc, pv, id := f.modifyPair("silver", "gold")
	pvc.Status.ModifyVolumeStatus = &v1.ModifyVolumeStatus{TargetVolumeAttributesClassName: "silver", Status: v1.PersistentVolumeClaimModifyVolumeInProgress}
	c := newModifyFixtureWith(t, f, false, pvc, pv, class("silver", "100"), class("gold", "500"))
	f.handled(c.queue, "start")
	f.syncExpecting(t, c, id, "100", "silver")
	if queued := f.handled(c.queue, "resumed"); !slices.Equal(queued, []string{"ns/claim"}) {
		t.Fatalf("queued after the resumed modification ended: %q, want ns/claim", queued)
	}
	f.syncExpecting(t, c, id, "500", "gold")
}

// The watch events of the modify controller's own writes of a failure do not requeue the
// PVC past its backoff.
func TestModifyOwnWriteEventsDoNotBypassBackoff(t *testing.T) {
	f := newFixture(t, testdriver.Config{})
	pvc, pv, _ := f.modifyPair("silver", "gold")
	c := newModifyFixtureWith(t, f, false, pvc, pv, class("silver", "100"), class("gold", "500"))
	f.handled(c.queue, "start")
	for attempt := range 3 {
		fault := testdriver.Fault{Method: testdriver.MethodControllerModifyVolume, Code: codes.Internal, Message: fmt.Sprintf("failure %d", attempt), Times: 1}
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
}
