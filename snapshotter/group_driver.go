package snapshotter

import (
	"context"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// groupInfo is what the driver tells of one group snapshot.
type groupInfo struct {
	id           string
	ready        bool
	creationTime time.Time
	// members are the group's snapshots, as CreateVolumeGroupSnapshot lists them.
	members []memberInfo
}

// memberInfo is one snapshot of a group and the volume it was taken of.
type memberInfo struct {
	volume string
	snapshotInfo
}

func groupInfoOf(g *csi.VolumeGroupSnapshot) groupInfo {
	info := groupInfo{id: g.GetGroupSnapshotId(), ready: g.GetReadyToUse()}
	if t := g.GetCreationTime(); t != nil {
		info.creationTime = t.AsTime()
	}
	for _, s := range g.GetSnapshots() {
		info.members = append(info.members, memberInfo{volume: s.GetSourceVolumeId(), snapshotInfo: infoOf(s)})
	}
	return info
}

func (d *driver) createGroupSnapshot(ctx context.Context, name string, volumes []string, params, secrets map[string]string) (groupInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	req := &csi.CreateVolumeGroupSnapshotRequest{Name: name, SourceVolumeIds: volumes, Parameters: params, Secrets: secrets}
	rsp, err := d.group.CreateVolumeGroupSnapshot(ctx, req)
	if err != nil {
		return groupInfo{}, err
	}
	return groupInfoOf(rsp.GetGroupSnapshot()), nil
}

func (d *driver) deleteGroupSnapshot(ctx context.Context, id string, snapshotIDs []string, secrets map[string]string) error {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	req := &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: id, SnapshotIds: snapshotIDs, Secrets: secrets}
	_, err := d.group.DeleteVolumeGroupSnapshot(ctx, req)
	return err
}

// groupSnapshotStatus asks GetVolumeGroupSnapshot about one group snapshot.
func (d *driver) groupSnapshotStatus(ctx context.Context, id string, snapshotIDs []string, secrets map[string]string) (groupInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	req := &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: id, SnapshotIds: snapshotIDs, Secrets: secrets}
	rsp, err := d.group.GetVolumeGroupSnapshot(ctx, req)
	if err != nil {
		return groupInfo{}, err
	}
	return groupInfoOf(rsp.GetGroupSnapshot()), nil
}
