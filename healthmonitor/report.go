package healthmonitor

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Upstream's event reasons and recovery message.
const (
	reasonAbnormal  = "VolumeConditionAbnormal"
	reasonNormal    = "VolumeConditionNormal"
	recoveryMessage = "The Volume returns to the healthy state"
)

// fieldState is what the monitor knows of whether the API server keeps a claim's
// status.healthStatus (the alpha CSIVolumeHealth gate of kube-apiserver).
type fieldState int

const (
	fieldUnknown fieldState = iota
	fieldServed
	fieldDropped
)

// reporter records a volume's health on its claim, and only when it changed: in
// status.healthStatus where the API server keeps that field, else as upstream's events.
//
// Whether the field is kept is learnt from the first write that sets it: the API server
// drops a field of a disabled gate from what it stores (unless the object had it already),
// so the answer of the merge patch shows whether it was kept. No discovery or OpenAPI
// document tells: both describe the field whatever the gate. A server that drops it costs
// that one patch per leadership term, which changes nothing (no new resourceVersion).
type reporter struct {
	kube     kubernetes.Interface
	claims   *lifecycle.OwnWrites[*v1.PersistentVolumeClaim]
	recorder record.EventRecorder

	mu    sync.Mutex
	field fieldState
	// reported holds, per claim, the key of the conditions the last event reported
	// ("" for healthy), in event mode only: an event is written when it changes.
	reported map[types.UID]string
}

// newReporter returns a reporter whose claims the caller sets before the informers start.
func newReporter(kube kubernetes.Interface, recorder record.EventRecorder) *reporter {
	return &reporter{kube: kube, recorder: recorder, reported: map[types.UID]string{}}
}

// startTerm forgets what a previous term learnt: the API server may have been restarted
// with the gate changed.
func (r *reporter) startTerm() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.field = fieldUnknown
}

func (r *reporter) fieldState() fieldState {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.field
}

func (r *reporter) setField(ctx context.Context, s fieldState) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.field == s {
		return
	}
	r.field = s
	if s == fieldDropped {
		klog.FromContext(ctx).Info("The API server does not keep PersistentVolumeClaim status.healthStatus (its CSIVolumeHealth feature gate is off): reporting volume health as events")
	} else {
		klog.FromContext(ctx).V(2).Info("The API server keeps PersistentVolumeClaim status.healthStatus: reporting volume health there")
	}
}

// report records conds (nil: healthy) as the health of pv's claim. It reads the claim from
// the cache, through its own writes, and writes nothing when the claim already shows
// conds. ctx is the write's context (Ops(): it records a driver call's result).
func (r *reporter) report(ctx context.Context, pv *v1.PersistentVolume, conds []v1.VolumeHealthCondition) error {
	claim := r.claimOf(pv)
	if claim == nil {
		return nil
	}
	if r.fieldState() != fieldDropped {
		done, err := r.writeStatus(ctx, claim, conds)
		if err != nil || done {
			return err
		}
	}
	r.event(claim, conds)
	return nil
}

// claimOf is the claim pv is bound to, from the cache; nil when there is none (deleted,
// or another claim of that name).
func (r *reporter) claimOf(pv *v1.PersistentVolume) *v1.PersistentVolumeClaim {
	ref := pv.Spec.ClaimRef
	if ref == nil {
		return nil
	}
	claim, ok, err := r.claims.Get(ref.Namespace + "/" + ref.Name)
	if err != nil || !ok || claim.Spec.VolumeName != pv.Name || (ref.UID != "" && ref.UID != claim.UID) {
		return nil
	}
	return claim
}

// writeStatus brings claim's status.healthStatus to conds if it differs. done is false
// when the API server turned out not to keep the field, so that the caller reports conds
// as an event instead.
func (r *reporter) writeStatus(ctx context.Context, claim *v1.PersistentVolumeClaim, conds []v1.VolumeHealthCondition) (done bool, err error) {
	var current []v1.VolumeHealthCondition
	var since metav1.Time
	if h := claim.Status.HealthStatus; h != nil {
		current, since = h.HealthConditions, h.LastTransitionTime
	}
	if sameConditions(current, conds) && (len(conds) > 0 || claim.Status.HealthStatus == nil) {
		return true, nil
	}
	var health *v1.VolumeHealthStatus
	if len(conds) > 0 {
		if !sameSet(current, conds) || since.IsZero() {
			since = metav1.NewTime(time.Now().Truncate(time.Second))
		}
		health = &v1.VolumeHealthStatus{HealthConditions: conds, LastTransitionTime: since}
	}
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"healthStatus": health}})
	if err != nil {
		return false, fmt.Errorf("encoding the health status of claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	written, err := r.kube.CoreV1().PersistentVolumeClaims(claim.Namespace).Patch(ctx, claim.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	switch {
	case apierrors.IsNotFound(err):
		r.claims.Gone(claim)
		return true, nil
	case err != nil:
		return false, fmt.Errorf("writing the health status of claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	r.claims.Wrote(written)
	if len(conds) > 0 {
		if written.Status.HealthStatus == nil {
			r.setField(ctx, fieldDropped)
			return false, nil
		}
		r.setField(ctx, fieldServed)
	}
	klog.FromContext(ctx).V(2).Info("Recorded volume health", "pvc", klog.KObj(claim), "conditions", len(conds))
	return true, nil
}

// event reports conds on claim as upstream's events, when they differ from what the last
// event reported for it. A claim reported healthy or never reported gets no
// VolumeConditionNormal.
func (r *reporter) event(claim *v1.PersistentVolumeClaim, conds []v1.VolumeHealthCondition) {
	key := ""
	if len(conds) > 0 {
		key = eventMessage(sortedCopy(conds))
	}
	r.mu.Lock()
	last, known := r.reported[claim.UID]
	r.reported[claim.UID] = key
	r.mu.Unlock()
	switch {
	case key != "" && key != last:
		r.recorder.Event(claim, v1.EventTypeWarning, reasonAbnormal, key)
	case key == "" && known && last != "":
		r.recorder.Event(claim, v1.EventTypeNormal, reasonNormal, recoveryMessage)
	}
}

// forget drops what the reporter holds about a deleted claim.
func (r *reporter) forget(uid types.UID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.reported, uid)
}
