package snapshotter

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// The group content's writes, by the rules of the content's (writes.go): patches of only
// what changes, from the group content as this sidecar last wrote or saw it, each answer
// back into OwnWrites. Upstream GETs the group content and updates it for status writes.

// patchGroupContent sends one patch and records its answer.
func (g *groupController) patchGroupContent(ctx context.Context, name string, pt types.PatchType, patch any, subresources ...string) (*groupv1.VolumeGroupSnapshotContent, error) {
	data, err := json.Marshal(patch)
	if err != nil {
		return nil, err
	}
	out, err := g.clients.snap.GroupsnapshotV1().VolumeGroupSnapshotContents().Patch(ctx, name, pt, data, metav1.PatchOptions{}, subresources...)
	if err != nil {
		return nil, fmt.Errorf("patching VolumeGroupSnapshotContent %s: %w", name, err)
	}
	g.contents.Wrote(out)
	return out, nil
}

// markCreating writes the being-created record before CreateVolumeGroupSnapshot (ctx:
// StartingWork).
func (g *groupController) markCreating(ctx context.Context, content *groupv1.VolumeGroupSnapshotContent) (*groupv1.VolumeGroupSnapshotContent, error) {
	if _, ok := content.Annotations[annGroupBeingCreated]; ok {
		return content, nil
	}
	return g.patchGroupContent(ctx, content.Name, types.MergePatchType,
		object{"metadata": object{"annotations": object{annGroupBeingCreated: "yes"}}})
}

// unmarkCreating removes the being-created record: the result is on the status, or the
// call failed for good.
func (g *groupController) unmarkCreating(ctx context.Context, content *groupv1.VolumeGroupSnapshotContent) (*groupv1.VolumeGroupSnapshotContent, error) {
	if _, ok := content.Annotations[annGroupBeingCreated]; !ok {
		return content, nil
	}
	return g.patchGroupContent(ctx, content.Name, types.MergePatchType,
		object{"metadata": object{"annotations": object{annGroupBeingCreated: nil}}})
}

// recordStatus writes what the driver told of the group snapshot, as upstream does: the
// handle, the creation time and the members once, readiness as it changes (clearing an
// error once ready). Nothing is written when nothing changes.
func (g *groupController) recordStatus(ctx context.Context, content *groupv1.VolumeGroupSnapshotContent, info groupInfo) (*groupv1.VolumeGroupSnapshotContent, error) {
	created := info.creationTime
	if created.IsZero() {
		created = time.Now()
	}
	st := content.Status
	if st == nil {
		st = &groupv1.VolumeGroupSnapshotContentStatus{}
	}
	patch := object{}
	if st.VolumeGroupSnapshotHandle == nil {
		patch["volumeGroupSnapshotHandle"] = info.id
	}
	if st.ReadyToUse == nil || *st.ReadyToUse != info.ready {
		patch["readyToUse"] = info.ready
		if info.ready && st.Error != nil {
			patch["error"] = nil
		}
	}
	if st.CreationTime == nil {
		patch["creationTime"] = metav1.NewTime(created)
	}
	if len(st.VolumeSnapshotInfoList) == 0 && len(info.members) > 0 {
		patch["volumeSnapshotInfoList"] = memberList(info.members)
	}
	if len(patch) == 0 {
		return content, nil
	}
	out, err := g.patchGroupContent(ctx, content.Name, types.MergePatchType, object{"status": patch}, "status")
	if err != nil {
		return content, fmt.Errorf("recording group snapshot %s on group content %s: %w", info.id, content.Name, err)
	}
	return out, nil
}

// memberList is the status's record of the group's snapshots, from which the
// snapshot-controller makes their VolumeSnapshots and VolumeSnapshotContents.
func memberList(members []memberInfo) []groupv1.VolumeSnapshotInfo {
	out := make([]groupv1.VolumeSnapshotInfo, 0, len(members))
	for _, m := range members {
		info := groupv1.VolumeSnapshotInfo{VolumeHandle: m.volume, SnapshotHandle: m.id, ReadyToUse: new(m.ready)}
		if !m.creationTime.IsZero() {
			info.CreationTime = new(m.creationTime.UnixNano())
		}
		if m.size != 0 {
			info.RestoreSize = new(m.size)
		}
		out = append(out, info)
	}
	return out
}

// failed records a failure on the group content's status and as an event, unless the
// status already says the same.
func (g *groupController) failed(ctx context.Context, content *groupv1.VolumeGroupSnapshotContent, reason, message string) {
	if st := content.Status; st != nil && st.Error != nil && st.Error.Message != nil && *st.Error.Message == message {
		return
	}
	status := object{"readyToUse": false, "error": object{"time": metav1.Now(), "message": message}}
	if _, err := g.patchGroupContent(ctx, content.Name, types.MergePatchType, object{"status": status}, "status"); err != nil {
		klog.FromContext(ctx).Error(err, "Recording the failure on the VolumeGroupSnapshotContent", "groupContent", content.Name)
	}
	g.recorder.Event(content, v1.EventTypeWarning, reason, message)
}

// release removes the finalizer once the group snapshot is deleted (or kept by policy).
// Where the group content outlives it (another finalizer), a deleted group snapshot's
// handle, readiness, creation time and error are cleared from its status, as upstream
// clears them before its own finalizer removal.
func (g *groupController) release(ctx context.Context, content *groupv1.VolumeGroupSnapshotContent) error {
	deleted := g.wasDeleted(content)
	if i := slices.Index(content.Finalizers, groupFinalizer); i >= 0 {
		// Remove this finalizer where it is, unless the list moved meanwhile (a conflict,
		// retried from the queue): other finalizers are others' to keep.
		path := fmt.Sprintf("/metadata/finalizers/%d", i)
		out, err := g.patchGroupContent(ctx, content.Name, types.JSONPatchType, []object{
			{"op": "test", "path": path, "value": groupFinalizer},
			{"op": "remove", "path": path},
		})
		if err != nil {
			return err
		}
		content = out
	}
	if deleted && len(content.Finalizers) > 0 && content.Status != nil && content.Status.VolumeGroupSnapshotHandle != nil {
		status := object{"volumeGroupSnapshotHandle": nil, "readyToUse": nil, "creationTime": nil, "error": nil}
		if _, err := g.patchGroupContent(ctx, content.Name, types.MergePatchType, object{"status": status}, "status"); err != nil {
			return err
		}
	}
	g.forgetDeleted(content.Name)
	return nil
}
