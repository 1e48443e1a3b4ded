package provisioner

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"
)

// savePVBackoff bounds how long one sync retries saving a PersistentVolume before it gives
// the claim back to the queue (which retries CreateVolume, idempotent, and the save).
func savePVBackoff() wait.Backoff {
	return wait.Backoff{Duration: 100 * time.Millisecond, Factor: 2, Steps: 6, Cap: 2 * time.Second}
}

// savePV creates the PersistentVolume on ctx (Ops(), P1), retrying transient API errors. A
// PersistentVolume of that name bound to the same claim is success: an earlier attempt, or
// the previous leader, saved it.
func (c *controller) savePV(ctx context.Context, pv *v1.PersistentVolume) error {
	var lastErr error
	err := wait.ExponentialBackoffWithContext(ctx, savePVBackoff(), func(ctx context.Context) (bool, error) {
		_, err := c.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
		switch {
		case err == nil:
			return true, nil
		case apierrors.IsAlreadyExists(err):
			existing, getErr := c.kube.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
			if getErr != nil {
				lastErr = getErr
				return false, nil
			}
			if ref := existing.Spec.ClaimRef; ref == nil || ref.UID != pv.Spec.ClaimRef.UID {
				return false, fmt.Errorf("PersistentVolume %s exists for another claim", pv.Name)
			}
			return true, nil
		default:
			klog.FromContext(ctx).Info("Saving PersistentVolume failed, retrying", "pv", pv.Name, "err", err.Error())
			lastErr = err
			return false, nil
		}
	})
	// When the backoff ran out (or ctx ended), the last API error says why; a final
	// answer (the name taken by another claim) is the error itself, whatever came before.
	if err != nil && wait.Interrupted(err) && lastErr != nil {
		return fmt.Errorf("saving PersistentVolume %s: %w", pv.Name, lastErr)
	}
	return err
}

// reschedule removes the selected node from the claim so that the scheduler picks again.
// It returns nil once done: the claim comes back when a node is selected.
func (c *controller) reschedule(ctx context.Context, claim *v1.PersistentVolumeClaim, why error) error {
	if _, ok := claim.Annotations[volumehelpers.AnnSelectedNode]; !ok {
		return why
	}
	patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:null}}}`, volumehelpers.AnnSelectedNode)
	ctx, cancel := context.WithTimeout(ctx, c.opts.timeout)
	defer cancel()
	if _, err := c.kube.CoreV1().PersistentVolumeClaims(claim.Namespace).Patch(ctx, claim.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("removing annotation %s from claim %s to reschedule (%v): %w", volumehelpers.AnnSelectedNode, klog.KObj(claim), why, err)
	}
	klog.FromContext(ctx).V(2).Info("Asked the scheduler for another node", "claim", klog.KObj(claim), "reason", why.Error())
	return nil
}
