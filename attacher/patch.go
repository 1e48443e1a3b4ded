package attacher

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
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

// markDetached records a successful unpublish and removes the finalizer. It returns the
// objects it wrote, in order.
//
// Fewer writes than upstream: when the VolumeAttachment is being deleted and ours is its
// last finalizer, removing it deletes the object, so the separate "attached: false" status
// write upstream makes first would be visible only for the instant before the object
// disappears; it is skipped. With other finalizers left the object stays, so the status
// is written first, as upstream does.
func (c *Controller) markDetached(ctx context.Context, va *storagev1.VolumeAttachment) ([]*storagev1.VolumeAttachment, error) {
	finalizer := finalizerName(c.driver)
	has := hasFinalizer(va.Finalizers, finalizer)
	remaining := withoutFinalizer(va.Finalizers, finalizer)
	goesAway := va.DeletionTimestamp != nil && has && len(remaining) == 0
	var written []*storagev1.VolumeAttachment
	if va.Status.Attached && !goesAway {
		clone := va.DeepCopy()
		clone.Status.Attached = false
		clone.Status.DetachError = nil
		clone.Status.AttachmentMetadata = nil
		var err error
		if va, err = c.patchVA(ctx, va, clone, true); err != nil {
			return written, fmt.Errorf("could not mark as detached: %w", err)
		}
		written = append(written, va)
	}
	if has {
		clone := va.DeepCopy()
		clone.Finalizers = remaining
		va, err := c.patchVA(ctx, va, clone, false)
		if err != nil {
			return written, fmt.Errorf("could not remove the finalizer: %w", err)
		}
		written = append(written, va)
	}
	return written, nil
}
