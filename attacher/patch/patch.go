// Package patch is the attacher's API writes to VolumeAttachments and PersistentVolumes:
// the finalizers and the status that record a publish or an unpublish, and the error of
// one that failed. Every write is a strategic merge patch of the difference between the
// cached object and the wanted one:
//   - finalizers are a merge list, so adding or removing ours never overwrites a finalizer
//     another controller changed meanwhile, and needs no resourceVersion: no conflicts, so
//     no retried writes;
//   - an empty difference is not sent at all (upstream sends "{}" patches, for example
//     when a forced resync finds the status already right).
//
// Each write is recorded in the caches read through the attacher's own writes
// (lifecycle.OwnWrites) as it returns, so that no sync starts from the copy it replaced.
package patch

import (
	"context"
	"encoding/json"
	"fmt"

	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/attacher/finalizer"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Writer writes the VolumeAttachments and PVs of one driver.
type Writer struct {
	kube kubernetes.Interface
	vas  *lifecycle.OwnWrites[*storagev1.VolumeAttachment]
	pvs  *lifecycle.OwnWrites[*corev1.PersistentVolume]
	// finalizer is the driver's (finalizer.Name).
	finalizer string
	// errorCodes records the gRPC code of a failed attach (MutableCSINodeAllocatableCount).
	errorCodes bool
}

// New returns the writer of driver's objects, recording its writes in vas and pvs. pvs
// may be nil when no PV is ever written (the trivial handler).
func New(kube kubernetes.Interface, vas *lifecycle.OwnWrites[*storagev1.VolumeAttachment], pvs *lifecycle.OwnWrites[*corev1.PersistentVolume], driver string, errorCodes bool) *Writer {
	return &Writer{kube: kube, vas: vas, pvs: pvs, finalizer: finalizer.Name(driver), errorCodes: errorCodes}
}

// twoWay is the strategic merge patch from old to updated; nil when they are equal.
func twoWay(old, updated, dataStruct any) ([]byte, error) {
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

// VA writes updated over old, to the status subresource when status is set. It returns
// old unchanged when there is nothing to write.
func (w *Writer) VA(ctx context.Context, old, updated *storagev1.VolumeAttachment, status bool) (*storagev1.VolumeAttachment, error) {
	patch, err := twoWay(old, updated, storagev1.VolumeAttachment{})
	if err != nil || patch == nil {
		return old, err
	}
	var sub []string
	if status {
		sub = []string{"status"}
	}
	va, err := w.kube.StorageV1().VolumeAttachments().Patch(ctx, old.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, sub...)
	if err != nil {
		return old, fmt.Errorf("patching VolumeAttachment %s: %w", old.Name, err)
	}
	w.vas.Wrote(va)
	return va, nil
}

// PV writes updated over old; nothing when they are equal.
func (w *Writer) PV(ctx context.Context, old, updated *corev1.PersistentVolume) (*corev1.PersistentVolume, error) {
	patch, err := twoWay(old, updated, corev1.PersistentVolume{})
	if err != nil || patch == nil {
		return old, err
	}
	pv, err := w.kube.CoreV1().PersistentVolumes().Patch(ctx, old.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return old, fmt.Errorf("patching PersistentVolume %s: %w", old.Name, err)
	}
	w.pvs.Wrote(pv)
	return pv, nil
}

// Attached records a successful publish: attached, its metadata, no attachError.
func (w *Writer) Attached(ctx context.Context, va *storagev1.VolumeAttachment, metadata map[string]string) (*storagev1.VolumeAttachment, error) {
	clone := va.DeepCopy()
	clone.Status.Attached = true
	clone.Status.AttachmentMetadata = metadata
	clone.Status.AttachError = nil
	return w.VA(ctx, va, clone, true)
}

// Detached records a successful unpublish: it removes our finalizer, then writes the
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
func (w *Writer) Detached(ctx context.Context, va *storagev1.VolumeAttachment) error {
	has := finalizer.Has(va.Finalizers, w.finalizer)
	if !has && !va.Status.Attached {
		return nil // as upstream: nothing of ours left to undo
	}
	if has {
		remaining := finalizer.Without(va.Finalizers, w.finalizer)
		clone := va.DeepCopy()
		clone.Finalizers = remaining
		updated, err := w.VA(ctx, va, clone, false)
		if err != nil {
			return fmt.Errorf("could not remove the finalizer: %w", err)
		}
		if va.DeletionTimestamp != nil && len(remaining) == 0 {
			return nil // the API server deleted it (VA recorded that, see OwnWrites.Wrote)
		}
		va = updated
	}
	clone := va.DeepCopy()
	clone.Status.Attached = false
	clone.Status.DetachError = nil
	clone.Status.AttachmentMetadata = nil
	_, err := w.VA(ctx, va, clone, true)
	if apierrors.IsNotFound(err) {
		return nil // deleted meanwhile: nothing left to record
	}
	if err != nil {
		return fmt.Errorf("could not mark as detached: %w", err)
	}
	return nil
}

// Failure writes err into the status (set puts it in place). A failed write is only
// logged: the error is retried anyway.
//
// No Event, as upstream: the status is where the error is read. kube-controller-manager
// waits on that status and reports a failed attach as a FailedAttachVolume Event on the
// Pods that wait for the volume, where users look; and upstream's RBAC, which drop-in users
// keep, does not grant the attacher events at all.
func (w *Writer) Failure(ctx context.Context, va *storagev1.VolumeAttachment, err error, set func(*storagev1.VolumeAttachmentStatus, *storagev1.VolumeError)) {
	if lifecycle.NotStarted(err) {
		// The call never reached the driver (draining, or no longer leading): no error to
		// show, and no write to spend on it; the next leader does the work.
		return
	}
	clone := va.DeepCopy()
	set(&clone.Status, volumeError(err, w.errorCodes, metav1.Now()))
	if _, saveErr := w.VA(ctx, va, clone, true); saveErr != nil {
		klog.FromContext(ctx).V(2).Info("Failed to save the error", "err", saveErr.Error())
	}
}

// volumeError is how a failure is recorded in a VolumeAttachment's status. withCode adds
// the gRPC code of a driver error (MutableCSINodeAllocatableCount).
func volumeError(err error, withCode bool, now metav1.Time) *storagev1.VolumeError {
	ve := &storagev1.VolumeError{Message: err.Error(), Time: now}
	if withCode {
		if st, ok := status.FromError(err); ok {
			code := int32(st.Code())
			ve.ErrorCode = &code
		}
	}
	return ve
}
