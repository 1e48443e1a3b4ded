package provisioner

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
		created, err := c.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
		switch {
		case err == nil:
			c.ownPVs.Wrote(created)
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
			c.ownPVs.Wrote(existing)
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
//
// It updates rather than patches: upstream's RBAC grants update on persistentvolumeclaims,
// not patch. The update carries the resource version of the freshest copy this process
// knows; a conflict (the scheduler was faster, or the claim changed) goes back to the
// queue, which decides again from the cache (P14).
func (c *controller) reschedule(ctx context.Context, claim *v1.PersistentVolumeClaim, why error) error {
	node, ok := claim.Annotations[volumehelpers.AnnSelectedNode]
	if !ok {
		return why
	}
	logger := klog.FromContext(ctx)
	if fresh := c.claimByUID(string(claim.UID)); fresh != nil && fresh.ResourceVersion != claim.ResourceVersion {
		if fresh.Annotations[volumehelpers.AnnSelectedNode] != node {
			logger.V(4).Info("Not rescheduling: the claim's node changed meanwhile", "claim", klog.KObj(claim), "node", node)
			return nil
		}
		claim = fresh
	}
	update := claim.DeepCopy()
	delete(update.Annotations, volumehelpers.AnnSelectedNode)
	out, err := c.kube.CoreV1().PersistentVolumeClaims(claim.Namespace).Update(ctx, update, metav1.UpdateOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil
	case err != nil:
		err = fmt.Errorf("removing annotation %s from claim %s to reschedule (%v): %w", volumehelpers.AnnSelectedNode, klog.KObj(claim), why, err)
		logger.Error(err, "Cannot ask the scheduler for another node, retrying")
		return err
	}
	// The copies before the update still select the node: a sync must not plan for it
	// again from one of them.
	c.ownClaims.Wrote(out)
	logger.V(2).Info("Asked the scheduler for another node", "claim", klog.KObj(claim), "node", node, "reason", why.Error())
	return nil
}
