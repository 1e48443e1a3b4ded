package attacher

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
)

// API writes. Every write is a strategic merge patch of the difference between the cached
// object and the wanted one:
//   - finalizers are a merge list, so adding or removing ours never overwrites a finalizer
//     another controller changed meanwhile, and needs no resourceVersion: no conflicts, so
//     no retried writes;
//   - an empty difference is not sent at all (upstream sends "{}" patches, for example
//     when a forced resync finds the status already right).

// twoWayPatch is the strategic merge patch from old to updated; nil when they are equal.
func twoWayPatch(old, updated, dataStruct any) ([]byte, error) {
	oldJSON, err := json.Marshal(old)
	if err != nil {
		return nil, err
	}
	newJSON, err := json.Marshal(updated)
	if err != nil {
		return nil, err
	}
	patch, err := strategicpatch.CreateTwoWayMergePatch(oldJSON, newJSON, dataStruct)
	if err != nil {
		return nil, err
	}
	if string(patch) == "{}" {
		return nil, nil
	}
	return patch, nil
}

// patchVA writes updated over old, to the status subresource when status is set. It
// returns old unchanged when there is nothing to write.
func (c *Controller) patchVA(ctx context.Context, old, updated *storagev1.VolumeAttachment, status bool) (*storagev1.VolumeAttachment, error) {
	patch, err := twoWayPatch(old, updated, storagev1.VolumeAttachment{})
	if err != nil || patch == nil {
		return old, err
	}
	var sub []string
	if status {
		sub = []string{"status"}
	}
	va, err := c.kube.StorageV1().VolumeAttachments().Patch(ctx, old.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, sub...)
	if err != nil {
		return old, fmt.Errorf("patching VolumeAttachment %s: %w", old.Name, err)
	}
	c.vas.Wrote(va)
	return va, nil
}

// patchPV writes updated over old; nothing when they are equal.
func (c *Controller) patchPV(ctx context.Context, old, updated *corev1.PersistentVolume) (*corev1.PersistentVolume, error) {
	patch, err := twoWayPatch(old, updated, corev1.PersistentVolume{})
	if err != nil || patch == nil {
		return old, err
	}
	pv, err := c.kube.CoreV1().PersistentVolumes().Patch(ctx, old.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return old, fmt.Errorf("patching PersistentVolume %s: %w", old.Name, err)
	}
	c.pvs.Wrote(pv)
	return pv, nil
}

// markAttached records a successful publish: attached, its metadata, no attachError.
func (c *Controller) markAttached(ctx context.Context, va *storagev1.VolumeAttachment, metadata map[string]string) (*storagev1.VolumeAttachment, error) {
	clone := va.DeepCopy()
	clone.Status.Attached = true
	clone.Status.AttachmentMetadata = metadata
	clone.Status.AttachError = nil
	return c.patchVA(ctx, va, clone, true)
}

// markDetached records a successful unpublish: it removes our finalizer, then writes the
// status (attached false, no metadata, no detachError).
//
// The order is upstream's, and it is what makes a crash (or a failed write) between the two
// writes harmless: a VolumeAttachment being deleted without our finalizer counts as
// detached whatever its status says, so no later sync unpublishes it again. The other order
// leaves "finalizer present, attached: false" behind, which is also what an attach that
// timed out looks like, so the next sync would call ControllerUnpublishVolume a second time.
//
// The status write follows every finalizer removal, so a detachError left by a failed
// earlier attempt is cleared on a VolumeAttachment that stays (another finalizer keeps it),
// even when it no longer said attached.
//
// Fewer writes than upstream: when removing ours deletes the VolumeAttachment (being
// deleted, ours its last finalizer), the status write could only fail with NotFound
// (upstream sends it and ignores that), so it is skipped; and a status that is already
// right is not written again (upstream sends an empty patch).
func (c *Controller) markDetached(ctx context.Context, va *storagev1.VolumeAttachment) error {
	finalizer := finalizerName(c.driver)
	has := hasFinalizer(va.Finalizers, finalizer)
	if !has && !va.Status.Attached {
		return nil // as upstream: nothing of ours left to undo
	}
	if has {
		remaining := withoutFinalizer(va.Finalizers, finalizer)
		clone := va.DeepCopy()
		clone.Finalizers = remaining
		updated, err := c.patchVA(ctx, va, clone, false)
		if err != nil {
			return fmt.Errorf("could not remove the finalizer: %w", err)
		}
		if va.DeletionTimestamp != nil && len(remaining) == 0 {
			return nil // the API server deleted it (patchVA recorded that, see OwnWrites.Wrote)
		}
		va = updated
	}
	clone := va.DeepCopy()
	clone.Status.Attached = false
	clone.Status.DetachError = nil
	clone.Status.AttachmentMetadata = nil
	_, err := c.patchVA(ctx, va, clone, true)
	if apierrors.IsNotFound(err) {
		return nil // deleted meanwhile: nothing left to record
	}
	if err != nil {
		return fmt.Errorf("could not mark as detached: %w", err)
	}
	return nil
}
