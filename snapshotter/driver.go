package snapshotter

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// driver makes the snapshotter's CSI calls, each bounded by --timeout and on the context it
// is given (the core's Ops(), so a SIGTERM lets it finish: P1). It logs none of them:
// csi-lib-utils' interceptor on the connection logs each at -v=5, as upstream's.
type driver struct {
	name    string
	ctrl    csi.ControllerClient
	group   csi.GroupControllerClient
	timeout time.Duration
	// lists tells whether the driver has LIST_SNAPSHOTS; without it a pre-provisioned
	// snapshot is taken to be ready, as upstream does.
	lists bool
}

func driverFor(env *lifecycle.Env, o options) *driver {
	return &driver{
		name:    env.DriverName,
		ctrl:    csi.NewControllerClient(env.CSI),
		group:   csi.NewGroupControllerClient(env.CSI),
		timeout: o.timeout,
		lists:   env.ControllerCapabilities[csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS],
	}
}

// owns tells whether a content of either kind is this driver's: it has a source
// (hasSource), names the driver, and its class, when it names one the cache knows
// (classDriver), is of the driver too.
func (d *driver) owns(hasSource bool, contentDriver string, class *string, classDriver func(name string) (string, error)) bool {
	if !hasSource || contentDriver != d.name {
		return false
	}
	if class != nil {
		if name, err := classDriver(*class); err == nil && name != d.name {
			return false
		}
	}
	return true
}

// snapshotInfo is what the driver tells of one snapshot.
type snapshotInfo struct {
	id           string
	ready        bool
	creationTime time.Time
	size         int64
	groupID      string
}

func infoOf(s *csi.Snapshot) snapshotInfo {
	info := snapshotInfo{id: s.GetSnapshotId(), ready: s.GetReadyToUse(), size: s.GetSizeBytes(), groupID: s.GetGroupSnapshotId()}
	if t := s.GetCreationTime(); t != nil {
		info.creationTime = t.AsTime()
	}
	return info
}

func (d *driver) createSnapshot(ctx context.Context, name, volume string, params, secrets map[string]string) (snapshotInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	req := &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: volume, Parameters: params, Secrets: secrets}
	rsp, err := d.ctrl.CreateSnapshot(ctx, req)
	if err != nil {
		return snapshotInfo{}, err
	}
	return infoOf(rsp.GetSnapshot()), nil
}

func (d *driver) deleteSnapshot(ctx context.Context, id string, secrets map[string]string) error {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	req := &csi.DeleteSnapshotRequest{SnapshotId: id, Secrets: secrets}
	_, err := d.ctrl.DeleteSnapshot(ctx, req)
	return err
}

// snapshotStatus asks ListSnapshots about one snapshot; a driver that cannot list has its
// snapshots ready (upstream's rule).
func (d *driver) snapshotStatus(ctx context.Context, id string, secrets map[string]string) (snapshotInfo, error) {
	if !d.lists {
		return snapshotInfo{id: id, ready: true}, nil
	}
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	req := &csi.ListSnapshotsRequest{SnapshotId: id, Secrets: secrets}
	rsp, err := d.ctrl.ListSnapshots(ctx, req)
	if err != nil {
		return snapshotInfo{}, err
	}
	if len(rsp.GetEntries()) == 0 {
		return snapshotInfo{}, fmt.Errorf("the driver lists no snapshot %s", id)
	}
	return infoOf(rsp.GetEntries()[0].GetSnapshot()), nil
}

// objectName is the name the driver gets for the snapshot (or group snapshot) of the object
// with this UID: prefix-UID, or prefix and the first n hexadecimal digits of the UID.
// Upstream crashes on an n the UID does not have; here the whole UID is used.
func objectName(prefix, uid string, n int) (string, error) {
	if uid == "" {
		return "", fmt.Errorf("the object it snapshots has no UID")
	}
	if n == -1 {
		return prefix + "-" + uid, nil
	}
	digits := strings.ReplaceAll(uid, "-", "")
	if n > 0 && n < len(digits) {
		digits = digits[:n]
	}
	return prefix + "-" + digits, nil
}
