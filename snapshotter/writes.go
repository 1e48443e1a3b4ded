package snapshotter

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// The content's writes. Each is a patch of only what changes, from the content as this
// sidecar last wrote or saw it (the cache read through OwnWrites), never from a GET made
// for the write; its answer goes back into OwnWrites. Upstream GETs the content before each
// status write.

// patchContent sends one patch and records its answer.
func (c *contentController) patchContent(ctx context.Context, name string, pt types.PatchType, patch any, subresources ...string) (*snapv1.VolumeSnapshotContent, error) {
	data, err := json.Marshal(patch)
	if err != nil {
		return nil, err
	}
	out, err := c.clients.snap.SnapshotV1().VolumeSnapshotContents().Patch(ctx, name, pt, data, metav1.PatchOptions{}, subresources...)
	if err != nil {
		return nil, fmt.Errorf("patching VolumeSnapshotContent %s: %w", name, err)
	}
	c.contents.Wrote(out)
	return out, nil
}

type object = map[string]any

// markCreating writes the being-created record before CreateSnapshot (ctx: StartingWork).
func (c *contentController) markCreating(ctx context.Context, content *snapv1.VolumeSnapshotContent) (*snapv1.VolumeSnapshotContent, error) {
	if _, ok := content.Annotations[annBeingCreated]; ok {
		return content, nil
	}
	return c.patchContent(ctx, content.Name, types.MergePatchType,
		object{"metadata": object{"annotations": object{annBeingCreated: "yes"}}})
}

// unmarkCreating removes the being-created record: the result is on the status, or the
// call failed for good.
func (c *contentController) unmarkCreating(ctx context.Context, content *snapv1.VolumeSnapshotContent) (*snapv1.VolumeSnapshotContent, error) {
	if _, ok := content.Annotations[annBeingCreated]; !ok {
		return content, nil
	}
	return c.patchContent(ctx, content.Name, types.MergePatchType,
		object{"metadata": object{"annotations": object{annBeingCreated: nil}}})
}

// recordStatus writes what the driver told of the snapshot, as upstream does: the handle,
// creation time and restore size once, readiness as it changes (clearing an error once
// ready). Nothing is written when nothing changes.
func (c *contentController) recordStatus(ctx context.Context, content *snapv1.VolumeSnapshotContent, info snapshotInfo) (*snapv1.VolumeSnapshotContent, error) {
	created := info.creationTime
	if created.IsZero() {
		created = time.Now()
	}
	st := content.Status
	if st == nil {
		st = &snapv1.VolumeSnapshotContentStatus{}
	}
	patch := object{}
	if st.SnapshotHandle == nil {
		patch["snapshotHandle"] = info.id
	}
	if st.ReadyToUse == nil || *st.ReadyToUse != info.ready {
		patch["readyToUse"] = info.ready
		if info.ready && st.Error != nil {
			patch["error"] = nil
		}
	}
	if st.CreationTime == nil {
		patch["creationTime"] = created.UnixNano()
	}
	if st.RestoreSize == nil && info.size > 0 {
		patch["restoreSize"] = info.size
	}
	if st.VolumeGroupSnapshotHandle == nil && info.groupID != "" {
		patch["volumeGroupSnapshotHandle"] = info.groupID
	}
	if len(patch) == 0 {
		return content, nil
	}
	out, err := c.patchContent(ctx, content.Name, types.MergePatchType, object{"status": patch}, "status")
	if err != nil {
		return content, fmt.Errorf("recording snapshot %s on content %s: %w", info.id, content.Name, err)
	}
	return out, nil
}

// failed records a failure on the content's status and as an event, unless the status
// already says the same.
func (c *contentController) failed(ctx context.Context, content *snapv1.VolumeSnapshotContent, reason, message string) {
	if st := content.Status; st != nil && st.Error != nil && st.Error.Message != nil && *st.Error.Message == message {
		return
	}
	status := object{"readyToUse": false, "error": object{"time": metav1.Now(), "message": message}}
	if _, err := c.patchContent(ctx, content.Name, types.MergePatchType, object{"status": status}, "status"); err != nil {
		klog.FromContext(ctx).Error(err, "Recording the failure on the VolumeSnapshotContent", "content", content.Name)
	}
	c.recorder.Event(content, v1.EventTypeWarning, reason, message)
}

// release removes the finalizer once the snapshot is deleted (or kept by policy). Where
// the content outlives it (another finalizer), a deleted snapshot's handle is cleared
// from its status, as upstream does before its own finalizer removal.
func (c *contentController) release(ctx context.Context, content *snapv1.VolumeSnapshotContent) error {
	deleted := c.wasDeleted(content)
	if i := slices.Index(content.Finalizers, contentFinalizer); i >= 0 {
		// Remove this finalizer where it is, unless the list moved meanwhile (a conflict,
		// retried from the queue): other finalizers are others' to keep.
		path := fmt.Sprintf("/metadata/finalizers/%d", i)
		out, err := c.patchContent(ctx, content.Name, types.JSONPatchType, []object{
			{"op": "test", "path": path, "value": contentFinalizer},
			{"op": "remove", "path": path},
		})
		if err != nil {
			return err
		}
		content = out
	}
	if deleted && len(content.Finalizers) > 0 && content.Status != nil && content.Status.SnapshotHandle != nil {
		status := object{"snapshotHandle": nil, "readyToUse": nil, "creationTime": nil, "restoreSize": nil}
		if _, err := c.patchContent(ctx, content.Name, types.MergePatchType, object{"status": status}, "status"); err != nil {
			return err
		}
	}
	c.forgetDeleted(content.Name)
	return nil
}
