package snapshotter

import (
	"context"
	"fmt"
	"time"

	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The group content's own writes; the shared ones are in contents.go. Upstream GETs the
// group content and updates it for status writes.

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
	patch := fields{}
	if st.VolumeGroupSnapshotHandle == nil {
		patch["volumeGroupSnapshotHandle"] = info.id
	}
	readiness(patch, st.ReadyToUse, st.Error != nil, info.ready)
	if st.CreationTime == nil {
		patch["creationTime"] = metav1.NewTime(created)
	}
	if len(st.VolumeSnapshotInfoList) == 0 && len(info.members) > 0 {
		patch["volumeSnapshotInfoList"] = memberList(info.members)
	}
	if len(patch) == 0 {
		return content, nil
	}
	out, err := g.patchStatus(ctx, content, patch)
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
	var same *string
	if st := content.Status; st != nil && st.Error != nil {
		same = st.Error.Message
	}
	g.contents.failed(ctx, content, same, reason, message)
}

// release removes the finalizer once the group snapshot is deleted (or kept by policy); a
// group content that outlives it has a deleted group snapshot's handle, readiness,
// creation time and error cleared from its status.
func (g *groupController) release(ctx context.Context, content *groupv1.VolumeGroupSnapshotContent) error {
	var clear fields
	if content.Status != nil && content.Status.VolumeGroupSnapshotHandle != nil {
		clear = fields{"volumeGroupSnapshotHandle": nil, "readyToUse": nil, "creationTime": nil, "error": nil}
	}
	return g.contents.release(ctx, content, groupFinalizer, clear)
}
