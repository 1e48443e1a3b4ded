package snapshotter

import (
	"context"
	"fmt"
	"time"

	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
)

// The content's own writes; the shared ones (annotations, finalizer, failures) are in
// contents.go. Upstream GETs the content before each status write; here the base is the
// cached copy read through OwnWrites.

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
	patch := fields{}
	if st.SnapshotHandle == nil {
		patch["snapshotHandle"] = info.id
	}
	readiness(patch, st.ReadyToUse, st.Error != nil, info.ready)
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
	out, err := c.patchStatus(ctx, content, patch)
	if err != nil {
		return content, fmt.Errorf("recording snapshot %s on content %s: %w", info.id, content.Name, err)
	}
	return out, nil
}

// failed records a failure on the content's status and as an event, unless the status
// already says the same.
func (c *contentController) failed(ctx context.Context, content *snapv1.VolumeSnapshotContent, reason, message string) {
	var same *string
	if st := content.Status; st != nil && st.Error != nil {
		same = st.Error.Message
	}
	c.contents.failed(ctx, content, same, reason, message)
}

// release removes the finalizer once the snapshot is deleted (or kept by policy); a
// content that outlives it has a deleted snapshot's handle cleared from its status.
func (c *contentController) release(ctx context.Context, content *snapv1.VolumeSnapshotContent) error {
	var clear fields
	if content.Status != nil && content.Status.SnapshotHandle != nil {
		clear = fields{"snapshotHandle": nil, "readyToUse": nil, "creationTime": nil, "restoreSize": nil}
	}
	return c.contents.release(ctx, content, contentFinalizer, clear)
}
