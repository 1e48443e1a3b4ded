package resizer

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

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
	writer
	modifier      *modifier
	informers     informers.SharedInformerFactory
	resync        time.Duration
	retryStart    time.Duration
	retryMax      time.Duration
	extraMetadata bool
}

// modifyController applies a PVC's VolumeAttributesClass to its volume.
type modifyController struct {
	writer
	modifier      *modifier
	extraMetadata bool
	retryMax      time.Duration

	pvcs  corelisters.PersistentVolumeClaimLister
	pvs   corelisters.PersistentVolumeLister
	vacs  storagelisters.VolumeAttributesClassLister
	queue workqueue.TypedRateLimitingInterface[string]

	mu sync.Mutex
	// uncertain holds PVCs whose last ControllerModifyVolume ended without a final answer:
	// the driver may still be applying that class, so a rollback must call it again.
	uncertain map[string]bool
	// infeasibleAt holds when a PVC's target class was refused as infeasible.
	infeasibleAt map[string]time.Time
}

func newModifyController(cfg modifyConfig) (*modifyController, error) {
	c := &modifyController{
		writer:        cfg.writer,
		modifier:      cfg.modifier,
		extraMetadata: cfg.extraMetadata,
		retryMax:      cfg.retryMax,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](cfg.retryStart, cfg.retryMax),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "resizer-" + cfg.driver + "-modify-pvc"}),
		uncertain:    map[string]bool{},
		infeasibleAt: map[string]time.Time{},
	}
	pvcInformer := cfg.informers.Core().V1().PersistentVolumeClaims()
	c.pvcs = pvcInformer.Lister()
	c.claims = pvcInformer.Informer().GetStore()
	c.pvs = cfg.informers.Core().V1().PersistentVolumes().Lister()
	cfg.informers.Core().V1().PersistentVolumes().Informer()
	vacInformer := cfg.informers.Storage().V1().VolumeAttributesClasses()
	c.vacs = vacInformer.Lister()
	if _, err := pvcInformer.Informer().AddEventHandlerWithResyncPeriod(cache.ResourceEventHandlerFuncs{
		AddFunc: c.enqueue,
		UpdateFunc: func(oldObj, newObj any) {
			old, ok1 := oldObj.(*v1.PersistentVolumeClaim)
			pvc, ok2 := newObj.(*v1.PersistentVolumeClaim)
			// Only a user's change, a binding or a resync can start work; the
			// controller's own status writes must not requeue a failure at once.
			if ok1 && ok2 && (!equalClass(old.Spec.VolumeAttributesClassName, pvc.Spec.VolumeAttributesClassName) ||
				!equalClass(old.Status.CurrentVolumeAttributesClassName, pvc.Status.CurrentVolumeAttributesClassName) ||
				old.Status.Phase != pvc.Status.Phase || old.ResourceVersion == pvc.ResourceVersion) {
				c.enqueue(pvc)
			}
		},
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
	c.mu.Lock()
	delete(c.uncertain, key)
	delete(c.infeasibleAt, key)
	c.mu.Unlock()
}

func (c *modifyController) run(intake context.Context, workers int) {
	lifecycle.RunWorkers(intake, c.queue, workers, c.sync)
}

// sync applies one PVC's class to its volume, or rolls back to the class it has.
func (c *modifyController) sync(key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	pvc, err := c.pvcs.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if pvc.Status.Phase != v1.ClaimBound || pvc.Spec.VolumeName == "" {
		return nil
	}
	pv, err := c.pvs.Get(pvc.Spec.VolumeName)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if !ofDriver(pv, c.driver) || !boundTo(pv, pvc) {
		return nil
	}
	target, current := pvc.Spec.VolumeAttributesClassName, pvc.Status.CurrentVolumeAttributesClassName
	switch {
	case target != nil && *target != "" && (current == nil || *current != *target):
		return c.modifyTo(key, pvc, pv, *target)
	case target != nil && current != nil && *target == *current && pvc.Status.ModifyVolumeStatus != nil:
		return c.rollBack(key, pvc, pv, *target)
	}
	return nil
}

// modifyTo applies class to the volume: InProgress, ControllerModifyVolume, recorded.
func (c *modifyController) modifyTo(key string, pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, class string) error {
	if s := pvc.Status.ModifyVolumeStatus; s != nil && s.Status == v1.PersistentVolumeClaimModifyVolumeInfeasible && s.TargetVolumeAttributesClassName == class {
		if wait := c.infeasibleWait(key); wait > 0 {
			c.queue.AddAfter(key, wait)
			return nil
		}
	}
	vac, err := c.vacs.Get(class)
	if apierrors.IsNotFound(err) {
		c.recorder.Eventf(pvc, v1.EventTypeWarning, reasonModifyFailed, "VAC %s does not exist.", class)
		if c.isUncertain(key) {
			// The last class may still be applied by the driver: keep it InProgress.
			return err
		}
		// Pending until the class exists: its creation enqueues the PVC.
		_, err := c.patchClaim(pvc, markModifyPending(pvc, class), true)
		return err
	}
	if err != nil {
		return err
	}
	updated, err := c.patchClaim(pvc, markModifyInProgress(pvc, class), true)
	if err != nil {
		return fmt.Errorf("marking the modification in progress: %w", err)
	}
	if updated != pvc {
		c.recorder.Eventf(updated, v1.EventTypeNormal, reasonModify, "external resizer is modifying volume %s with vac %s", pvc.Name, class)
	}
	return c.apply(key, updated, pv, vac)
}

// rollBack returns a PVC to the class it has after a modification failed or waits: if the
// driver may still be applying the other class, the current one is applied again;
// otherwise only the status is cleared.
func (c *modifyController) rollBack(key string, pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, class string) error {
	if !c.isUncertain(key) {
		_, err := c.patchClaim(pvc, markModifyCompleted(pvc, class), true)
		return err
	}
	vac, err := c.vacs.Get(class)
	if err != nil {
		return fmt.Errorf("rolling back to VolumeAttributesClass %s: %w", class, err)
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
	ctx, cancel := c.opContext()
	ctx = klog.NewContext(ctx, klog.Background().WithValues("pvc", key))
	callErr := c.modifier.modify(ctx, pv, params)
	cancel()
	if callErr != nil {
		return c.recordFailure(key, pvc, vac.Name, callErr)
	}
	c.mu.Lock()
	delete(c.uncertain, key)
	delete(c.infeasibleAt, key)
	c.mu.Unlock()
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

// recordFailure writes the error (and Infeasible for InvalidArgument) in one patch.
func (c *modifyController) recordFailure(key string, pvc *v1.PersistentVolumeClaim, class string, callErr error) error {
	if _, ok := status.FromError(callErr); !ok {
		// Failed before the driver was called (a secret could not be read): retry.
		c.recorder.Event(pvc, v1.EventTypeWarning, reasonModifyFailed, callErr.Error())
		return callErr
	}
	final := isFinal(callErr)
	infeasible := final && status.Code(callErr) == codes.InvalidArgument
	c.mu.Lock()
	if final {
		delete(c.uncertain, key)
	} else {
		c.uncertain[key] = true
	}
	if infeasible {
		c.infeasibleAt[key] = time.Now()
	}
	c.mu.Unlock()
	err := callErr
	if _, werr := c.patchClaim(pvc, markModifyFailed(pvc, class, callErr, infeasible), true); werr != nil {
		err = fmt.Errorf("modifying failed with %w and recording it failed: %v", callErr, werr)
	}
	c.recorder.Event(pvc, v1.EventTypeWarning, reasonModifyFailed, callErr.Error())
	if infeasible && err == callErr {
		// Retried slowly, or at once when the user changes the class.
		c.queue.AddAfter(key, c.retryMax)
		return nil
	}
	return err
}

func (c *modifyController) isUncertain(key string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.uncertain[key]
}

func (c *modifyController) infeasibleWait(key string) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	at, ok := c.infeasibleAt[key]
	if !ok {
		return 0
	}
	return max(0, c.retryMax-time.Since(at))
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
func markModifyInProgress(pvc *v1.PersistentVolumeClaim, class string) *v1.PersistentVolumeClaim {
	out := pvc.DeepCopy()
	out.Status.ModifyVolumeStatus = &v1.ModifyVolumeStatus{TargetVolumeAttributesClassName: class, Status: v1.PersistentVolumeClaimModifyVolumeInProgress}
	out.Status.Conditions = setCondition(out.Status.Conditions, newCondition(v1.PersistentVolumeClaimVolumeModifyingVolume, "ModifyVolume operation in progress."))
	return out
}

// markModifyFailed: the error condition, and Infeasible when the driver refused the class.
func markModifyFailed(pvc *v1.PersistentVolumeClaim, class string, err error, infeasible bool) *v1.PersistentVolumeClaim {
	out := pvc.DeepCopy()
	out.Status.Conditions = setCondition(out.Status.Conditions, newCondition(v1.PersistentVolumeClaimVolumeModifyVolumeError,
		"ModifyVolume failed with error: "+err.Error()+". Waiting for retry."))
	if infeasible {
		out.Status.ModifyVolumeStatus = &v1.ModifyVolumeStatus{TargetVolumeAttributesClassName: class, Status: v1.PersistentVolumeClaimModifyVolumeInfeasible}
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
