package resizer

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Keys of the extra metadata --extra-modify-metadata adds to mutable parameters.
const (
	paramPVCName      = "csi.storage.k8s.io/pvc/name"
	paramPVCNamespace = "csi.storage.k8s.io/pvc/namespace"
	paramPVName       = "csi.storage.k8s.io/pv/name"
)

// modifyConfig is what the modify controller is built from.
type modifyConfig struct {
	controllerConfig
	modifier      *modifier
	extraMetadata bool
}

// modifyController applies a PVC's VolumeAttributesClass to its volume.
type modifyController struct {
	writer
	modifier      *modifier
	extraMetadata bool

	pvcs  corelisters.PersistentVolumeClaimLister
	vacs  storagelisters.VolumeAttributesClassLister
	queue *lifecycle.Queue[string]
	// attempts says whether the driver may still be applying the class of a modification
	// the PVC's status says is InProgress (its last call ended without a final answer, or
	// this process never made it: a previous leader did), which must then be finished
	// before another class or a rollback is applied; and it holds back a class refused as
	// infeasible for --retry-interval-max.
	attempts *attempts
}

func newModifyController(cfg modifyConfig) (*modifyController, error) {
	c := &modifyController{
		writer:        cfg.writer,
		modifier:      cfg.modifier,
		extraMetadata: cfg.extraMetadata,
		queue:         cfg.newQueue(),
		attempts:      newAttempts(cfg.retryMax),
	}
	// The writer reads PVCs and PVs through these informers (newWriter registered them);
	// the lister only serves classAdded's scan.
	pvcInformer := cfg.informers.Core().V1().PersistentVolumeClaims()
	c.pvcs = pvcInformer.Lister()
	vacInformer := cfg.informers.Storage().V1().VolumeAttributesClasses()
	c.vacs = vacInformer.Lister()
	if _, err := pvcInformer.Informer().AddEventHandlerWithResyncPeriod(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueue,
		UpdateFunc: c.claimUpdated,
		DeleteFunc: c.claimDeleted,
	}, cfg.resync); err != nil {
		return nil, fmt.Errorf("registering the PVC handler: %w", err)
	}
	// A class created after a PVC named it ends that PVC's Pending state at once.
	if _, err := vacInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: c.classAdded}); err != nil {
		return nil, fmt.Errorf("registering the VolumeAttributesClass handler: %w", err)
	}
	return c, nil
}

// claimUpdated enqueues a PVC whose class (asked for or current) or phase changed, or
// whose modification ended (its status cleared, as upstream enqueues): only a user's change,
// a binding or a finished modification can start work, and the controller's own writes of a
// failure must not requeue it ahead of its backoff. A finished modification matters when it
// was resumed: the class the user asked for meanwhile starts now, even if the resumed class
// was the current one. A resync (same resourceVersion) enqueues too, to retry what is due,
// unless a failure's rate-limited retry is already pending.
func (c *modifyController) claimUpdated(oldObj, newObj any) {
	old, ok1 := oldObj.(*v1.PersistentVolumeClaim)
	pvc, ok2 := newObj.(*v1.PersistentVolumeClaim)
	if !ok1 || !ok2 {
		return
	}
	if old.ResourceVersion == pvc.ResourceVersion {
		resync(c.queue, pvc)
		return
	}
	if !equalClass(old.Spec.VolumeAttributesClassName, pvc.Spec.VolumeAttributesClassName) ||
		!equalClass(old.Status.CurrentVolumeAttributesClassName, pvc.Status.CurrentVolumeAttributesClassName) ||
		old.Status.Phase != pvc.Status.Phase ||
		old.Status.ModifyVolumeStatus != nil && pvc.Status.ModifyVolumeStatus == nil {
		c.enqueue(pvc)
	}
}

func equalClass(a, b *string) bool {
	return (a == nil) == (b == nil) && (a == nil || *a == *b)
}

func (c *modifyController) enqueue(obj any) {
	if key, ok := claimKey(obj); ok {
		c.queue.Add(key)
	}
}

func (c *modifyController) classAdded(obj any) {
	vac, ok := obj.(*storagev1.VolumeAttributesClass)
	if !ok {
		return
	}
	pvcs, err := c.pvcs.List(labels.Everything())
	if err != nil {
		return
	}
	for _, pvc := range pvcs {
		if s := pvc.Status.ModifyVolumeStatus; s != nil && s.Status == v1.PersistentVolumeClaimModifyVolumePending &&
			pvc.Spec.VolumeAttributesClassName != nil && *pvc.Spec.VolumeAttributesClassName == vac.Name {
			c.enqueue(pvc)
		}
	}
}

func (c *modifyController) claimDeleted(obj any) {
	key, ok := claimKey(obj)
	if !ok {
		return
	}
	c.queue.Forget(key)
	c.attempts.forget(key)
}

func (c *modifyController) run(intake context.Context, workers int) {
	c.intake = intake
	lifecycle.RunWorkers(intake, c.queue, workers, c.sync)
}

// sync applies one PVC's class to its volume, finishes a modification that may still run
// in the driver, or records that the user withdrew one.
func (c *modifyController) sync(key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	pvc, ok, err := c.claim(ns, name)
	if err != nil || !ok {
		return err
	}
	if pvc.Status.Phase != v1.ClaimBound || pvc.Spec.VolumeName == "" {
		return nil
	}
	plan := planModify(pvc, c.attempts.inDoubt(key))
	if plan.action == modifyNothing {
		return nil
	}
	pv, ok, err := c.volume(pvc.Spec.VolumeName)
	if err != nil {
		return err
	}
	if !ok {
		// The PV was created moments ago and the informer has not shown it yet (nothing
		// else would enqueue the PVC when it does): retried with backoff, as upstream.
		return fmt.Errorf("PV %s of PVC %s is not in the informer cache yet", pvc.Spec.VolumeName, key)
	}
	if !ofDriver(pv, c.driver) || !boundTo(pv, pvc) {
		return nil
	}
	switch plan.action {
	case modifyStart:
		return c.modifyTo(key, pvc, pv, plan.class)
	case modifyResume:
		return c.resume(key, pvc, pv, plan.class)
	case modifyCancel:
		return c.cancel(pvc)
	}
	return nil
}

// modifyAction is what one sync does about a PVC's class.
type modifyAction int

const (
	// modifyNothing: the volume has the class asked for, or the user withdrew a change
	// that is already recorded as withdrawn.
	modifyNothing modifyAction = iota
	// modifyStart applies the class the PVC asks for: InProgress, VolumeModify, the call.
	modifyStart
	// modifyResume calls the driver again with the class of the modification in progress,
	// whatever the PVC asks for now: the driver may still be applying it, and a different
	// class (or the current one, a rollback) must not race it or be recorded while the
	// volume may end up with it.
	modifyResume
	// modifyCancel records that the user withdrew a modification that no longer runs.
	modifyCancel
)

// modifyPlan is the decision of one sync: what to do, and with which class.
type modifyPlan struct {
	action modifyAction
	class  string
}

// planModify decides as upstream's modify (pkg/modifycontroller/modify_volume.go).
// inDoubt says whether the driver may still be carrying out the PVC's last call: it matters
// only for a modification whose status is InProgress. Such a modification is finished with
// its own class before anything else is applied, and so is one whose class the user cleared
// (a PVC without a current class may drop its spec's class again): the driver may apply it
// whatever the PVC asks for now, or already has. Every other change, including the return
// to the current class after a failure, is applied through the driver, since a refused or
// failed call may still have changed the volume.
func planModify(pvc *v1.PersistentVolumeClaim, inDoubt bool) modifyPlan {
	target := ptr.Deref(pvc.Spec.VolumeAttributesClassName, "")
	current := ptr.Deref(pvc.Status.CurrentVolumeAttributesClassName, "")
	st := pvc.Status.ModifyVolumeStatus
	if st == nil && target == current {
		return modifyPlan{}
	}
	inProgress := st != nil && st.Status == v1.PersistentVolumeClaimModifyVolumeInProgress
	switch {
	case target == "" && !inProgress:
		if hasCondition(pvc, v1.PersistentVolumeClaimVolumeModifyingVolume) {
			return modifyPlan{action: modifyCancel}
		}
		return modifyPlan{}
	case inProgress && (inDoubt || target == ""):
		if st.TargetVolumeAttributesClassName == "" {
			// Nothing names the class to finish; only a user's new class can start again.
			return modifyPlan{}
		}
		return modifyPlan{action: modifyResume, class: st.TargetVolumeAttributesClassName}
	}
	return modifyPlan{action: modifyStart, class: target}
}

func hasCondition(pvc *v1.PersistentVolumeClaim, t v1.PersistentVolumeClaimConditionType) bool {
	return slices.ContainsFunc(pvc.Status.Conditions, func(c v1.PersistentVolumeClaimCondition) bool { return c.Type == t })
}

// cancel drops the ModifyingVolume condition of a withdrawn modification and says so with
// upstream's VolumeModifyCanceled event. The modify status stays: it is the outcome of the
// last modification, as upstream keeps it.
func (c *modifyController) cancel(pvc *v1.PersistentVolumeClaim) error {
	out := pvc.DeepCopy()
	out.Status.Conditions = dropConditions(out.Status.Conditions, func(t v1.PersistentVolumeClaimConditionType) bool {
		return t == v1.PersistentVolumeClaimVolumeModifyingVolume
	})
	if _, err := c.patchClaim(pvc, out, false); err != nil {
		return fmt.Errorf("marking the modification of PVC %s/%s cancelled: %w", pvc.Namespace, pvc.Name, err)
	}
	c.recorder.Event(pvc, v1.EventTypeNormal, reasonModifyCancelled, "Cancelled modify.")
	return nil
}

// modifyTo applies class to the volume: InProgress, ControllerModifyVolume, recorded.
func (c *modifyController) modifyTo(key string, pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, class string) error {
	if s := pvc.Status.ModifyVolumeStatus; s != nil && s.Status == v1.PersistentVolumeClaimModifyVolumeInfeasible && s.TargetVolumeAttributesClassName == class {
		if wait := c.attempts.infeasibleWait(key); wait > 0 {
			c.queue.AddAfter(key, wait)
			return nil
		}
	}
	vac, err := c.vacs.Get(class)
	if apierrors.IsNotFound(err) {
		// Pending until the class exists: its creation enqueues the PVC. A PVC already
		// Pending for it (a resync) gets neither a write nor another event.
		updated, err := c.patchClaim(pvc, markModifyPending(pvc, class), true)
		if err == nil && updated != pvc {
			c.recorder.Eventf(pvc, v1.EventTypeWarning, reasonModifyFailed, "VAC %q does not exist.", class)
		}
		return err
	}
	if err != nil {
		return fmt.Errorf("getting VolumeAttributesClass %s: %w", class, err)
	}
	updated, err := c.startClaim(pvc, markModifyInProgress(pvc, class, metav1.Now()))
	if err != nil {
		return fmt.Errorf("marking the modification in progress: %w", err)
	}
	// Each attempt is announced, as upstream: a first one, or a retry after the driver's
	// final refusal. A resumed one is not (resume).
	c.recorder.Eventf(updated, v1.EventTypeNormal, reasonModify, "external resizer is modifying volume %s with vac %s", pvc.Name, class)
	// Nothing is in doubt now (planModify): a call that fails before reaching the driver
	// leaves it so, and the user may change the class.
	c.attempts.begin(key)
	return c.apply(key, updated, pv, vac)
}

// resume calls the driver again with the class of the modification in progress, without
// marking it again or announcing it, as upstream continues an uncertain one.
func (c *modifyController) resume(key string, pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, class string) error {
	vac, err := c.vacs.Get(class)
	if apierrors.IsNotFound(err) {
		c.recorder.Eventf(pvc, v1.EventTypeWarning, reasonModifyFailed, "VAC %q does not exist.", class)
	}
	if err != nil {
		return fmt.Errorf("getting VolumeAttributesClass %s of the modification in progress: %w", class, err)
	}
	return c.apply(key, pvc, pv, vac)
}

// apply calls ControllerModifyVolume and records the outcome, on Ops() (P1).
func (c *modifyController) apply(key string, pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, vac *storagev1.VolumeAttributesClass) error {
	params := maps.Clone(vac.Parameters)
	if c.extraMetadata {
		if params == nil {
			params = map[string]string{}
		}
		params[paramPVCName], params[paramPVCNamespace], params[paramPVName] = pvc.Name, pvc.Namespace, pv.Name
	}
	ctx, cancel := c.callContext()
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("pvc", key))
	callErr := c.modifier.modify(ctx, pv, params)
	cancel()
	if callErr != nil {
		return c.recordFailure(key, pvc, vac.Name, callErr)
	}
	c.attempts.forget(key)
	updatedPV := pv.DeepCopy()
	updatedPV.Spec.VolumeAttributesClassName = &vac.Name
	if _, err := c.patchVolume(pv, updatedPV); err != nil {
		return err
	}
	if _, err := c.patchClaim(pvc, markModifyCompleted(pvc, vac.Name), false); err != nil {
		return fmt.Errorf("modify volume failed to mark pvc %s modify volume completed: %w", key, err)
	}
	c.recorder.Eventf(pvc, v1.EventTypeNormal, reasonModifySucceeded, "external resizer modified volume %s with vac %s successfully", pvc.Name, vac.Name)
	return nil
}

// recordFailure writes the error conditions (and Infeasible for InvalidArgument) in one
// patch.
func (c *modifyController) recordFailure(key string, pvc *v1.PersistentVolumeClaim, class string, callErr error) error {
	if lifecycle.NotStarted(callErr) {
		// Never reached the driver (draining, or no longer leading): nothing to record;
		// the next leader modifies.
		return callErr
	}
	if _, ok := status.FromError(callErr); !ok {
		// Failed before the driver was called (a secret could not be read): retry. Upstream
		// records no event here; we do, because nothing else tells the user why the PVC
		// stays InProgress (the status records only the driver's answers), and the cause is
		// theirs to fix. Expansion records the same failure as VolumeResizeFailed, upstream
		// too.
		c.recorder.Event(pvc, v1.EventTypeWarning, reasonModifyFailed, callErr.Error())
		return callErr
	}
	final := lifecycle.IsFinalError(callErr)
	infeasible := final && status.Code(callErr) == codes.InvalidArgument
	c.attempts.failed(key, final, infeasible)
	if _, werr := c.patchClaim(pvc, markModifyFailed(pvc, class, callErr, metav1.Now()), true); werr != nil {
		// As upstream, the event goes with the recorded status: the retry records both.
		return fmt.Errorf("modifying failed with %w and recording it failed: %v", callErr, werr)
	}
	message := callErr.Error()
	if !final {
		message += ". Still modifying to VAC " + class // upstream's wording
	}
	c.recorder.Event(pvc, v1.EventTypeWarning, reasonModifyFailed, message)
	if infeasible {
		// Retried slowly, or at once when the user changes the class.
		c.queue.AddAfter(key, c.attempts.retryMax)
		return nil
	}
	return callErr
}

func isModifyCondition(t v1.PersistentVolumeClaimConditionType) bool {
	return t == v1.PersistentVolumeClaimVolumeModifyingVolume || t == v1.PersistentVolumeClaimVolumeModifyVolumeError
}

// markModifyPending: the class does not exist yet; conditions are left as they are.
func markModifyPending(pvc *v1.PersistentVolumeClaim, class string) *v1.PersistentVolumeClaim {
	out := pvc.DeepCopy()
	out.Status.ModifyVolumeStatus = &v1.ModifyVolumeStatus{TargetVolumeAttributesClassName: class, Status: v1.PersistentVolumeClaimModifyVolumePending}
	return out
}

// markModifyInProgress: the driver is about to be asked for class.
func markModifyInProgress(pvc *v1.PersistentVolumeClaim, class string, now metav1.Time) *v1.PersistentVolumeClaim {
	out := pvc.DeepCopy()
	out.Status.ModifyVolumeStatus = &v1.ModifyVolumeStatus{TargetVolumeAttributesClassName: class, Status: v1.PersistentVolumeClaimModifyVolumeInProgress}
	out.Status.Conditions = probeConditions(out.Status.Conditions, now, v1.PersistentVolumeClaimCondition{
		Type: v1.PersistentVolumeClaimVolumeModifyingVolume, Status: v1.ConditionTrue,
		Message: fmt.Sprintf("Modifying volume to %q is in progress.", class),
	})
	return out
}

// markModifyFailed records a failed call for class with upstream's conditions: the
// ModifyingVolume condition says whether the driver may still be applying it, and the
// ModifyVolumeError condition carries the gRPC code as its reason and the driver's message.
// Only InvalidArgument makes the modification Infeasible; every other error leaves it
// InProgress, retried.
func markModifyFailed(pvc *v1.PersistentVolumeClaim, class string, err error, now metav1.Time) *v1.PersistentVolumeClaim {
	out := pvc.DeepCopy()
	st := status.Convert(err)
	state := v1.PersistentVolumeClaimModifyVolumeInProgress
	if lifecycle.IsFinalError(err) && st.Code() == codes.InvalidArgument {
		state = v1.PersistentVolumeClaimModifyVolumeInfeasible
	}
	out.Status.ModifyVolumeStatus = &v1.ModifyVolumeStatus{TargetVolumeAttributesClassName: class, Status: state}
	modifying := fmt.Sprintf("Modifying volume to %q is still in progress.", class)
	if lifecycle.IsFinalError(err) {
		modifying = fmt.Sprintf("Modifying volume to %q failed. Waiting for retry.", class)
	}
	out.Status.Conditions = probeConditions(out.Status.Conditions, now,
		v1.PersistentVolumeClaimCondition{Type: v1.PersistentVolumeClaimVolumeModifyingVolume, Status: v1.ConditionTrue, Message: modifying},
		v1.PersistentVolumeClaimCondition{Type: v1.PersistentVolumeClaimVolumeModifyVolumeError, Status: v1.ConditionTrue, Reason: st.Code().String(), Message: st.Message()},
	)
	return out
}

// probeConditions sets the modify conditions as upstream's MergePVCConditions does: each
// is replaced and probed now (lastProbeTime), and keeps its lastTransitionTime unless its
// status or reason changed. Other conditions are left alone.
func probeConditions(conds []v1.PersistentVolumeClaimCondition, now metav1.Time, set ...v1.PersistentVolumeClaimCondition) []v1.PersistentVolumeClaimCondition {
	out := slices.Clone(conds)
	for _, c := range set {
		c.LastProbeTime, c.LastTransitionTime = now, now
		i := slices.IndexFunc(out, func(old v1.PersistentVolumeClaimCondition) bool { return old.Type == c.Type })
		if i < 0 {
			out = append(out, c)
			continue
		}
		if out[i].Status == c.Status && out[i].Reason == c.Reason {
			c.LastTransitionTime = out[i].LastTransitionTime
		}
		out[i] = c
	}
	return out
}

// markModifyCompleted: the volume has class; the modification's status and conditions go.
func markModifyCompleted(pvc *v1.PersistentVolumeClaim, class string) *v1.PersistentVolumeClaim {
	out := pvc.DeepCopy()
	out.Status.CurrentVolumeAttributesClassName = &class
	out.Status.ModifyVolumeStatus = nil
	out.Status.Conditions = dropConditions(out.Status.Conditions, isModifyCondition)
	return out
}
