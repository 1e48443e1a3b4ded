package testdriver

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Snapshot is the backend's record of one snapshot. Values returned by
// Backend methods are copies.
type Snapshot struct {
	ID string
	// Name is the name CreateSnapshot (or TakeSnapshot) was given; empty for
	// the members of a group snapshot, which are known by GroupSnapshotID.
	Name           string
	SourceVolumeID string
	// SizeBytes is the size of the source volume when the snapshot was
	// taken; a volume restored from it is at least this large.
	SizeBytes    int64
	CreationTime time.Time
	Parameters   map[string]string
	// GroupSnapshotID is the group snapshot this one is a member of, empty
	// for a snapshot cut on its own. Members go with their group only:
	// DeleteSnapshot refuses them with InvalidArgument, as the CSI spec
	// allows.
	GroupSnapshotID string
	// ReadyToUse is what the driver reports now: false until
	// Config.SnapshotReadyAfter and Config.SnapshotReadyAfterPolls have
	// passed or MarkSnapshotReady was called.
	ReadyToUse bool

	// notReadyReports counts the answers that described the snapshot as
	// not ready.
	notReadyReports int
}

// Snapshot ids are snapshotIDPrefix followed by volumeIDDigits digits, so
// that string order is creation order (ListSnapshots tokens rely on it).
const snapshotIDPrefix = "snap-"

func (s *Snapshot) clone() Snapshot {
	c := *s
	c.Parameters = maps.Clone(s.Parameters)
	return c
}

// snapshotReadyLocked says whether s is ready to use now, and, when report
// is set, counts an answer that describes it to the CO (which, while it is
// not ready, is one of the Config.SnapshotReadyAfterPolls it waits for). The
// caller holds b.mu.
func (b *Backend) snapshotReadyLocked(s *Snapshot, report bool) bool {
	if !s.ReadyToUse && time.Since(s.CreationTime) >= b.cfg.SnapshotReadyAfter && s.notReadyReports >= b.cfg.SnapshotReadyAfterPolls {
		s.ReadyToUse = true
	}
	if report && !s.ReadyToUse {
		s.notReadyReports++
	}
	return s.ReadyToUse
}

// snapshotToCSILocked describes s for an answer; report is as for
// snapshotReadyLocked. The caller holds b.mu.
func (b *Backend) snapshotToCSILocked(s *Snapshot, report bool) *csi.Snapshot {
	return &csi.Snapshot{
		SnapshotId:      s.ID,
		SourceVolumeId:  s.SourceVolumeID,
		SizeBytes:       s.SizeBytes,
		CreationTime:    timestamppb.New(s.CreationTime),
		ReadyToUse:      b.snapshotReadyLocked(s, report),
		GroupSnapshotId: s.GroupSnapshotID,
	}
}

// Snapshots returns a copy of every snapshot, members of group snapshots
// included, sorted by id. A test counts leaked snapshots by comparing these
// ids with the snapshot handles its VolumeSnapshotContents record.
func (b *Backend) Snapshots() []Snapshot {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]Snapshot, 0, len(b.snapshots))
	for _, id := range slices.Sorted(maps.Keys(b.snapshots)) {
		s := b.snapshots[id]
		b.snapshotReadyLocked(s, false)
		out = append(out, s.clone())
	}
	return out
}

// Snapshot returns a copy of the snapshot with the given id.
func (b *Backend) Snapshot(id string) (Snapshot, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s, ok := b.snapshots[id]
	if !ok {
		return Snapshot{}, false
	}
	b.snapshotReadyLocked(s, false)
	return s.clone(), true
}

// MarkSnapshotReady makes a snapshot, or every member of a group snapshot
// when id is a group snapshot id, ready to use at once, whatever
// Config.SnapshotReadyAfter and SnapshotReadyAfterPolls say. It reports
// whether id exists.
func (b *Backend) MarkSnapshotReady(id string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if s, ok := b.snapshots[id]; ok {
		s.ReadyToUse = true
		return true
	}
	g, ok := b.groupSnapshots[id]
	if !ok {
		return false
	}
	for _, m := range g.SnapshotIDs {
		if s, ok := b.snapshots[m]; ok {
			s.ReadyToUse = true
		}
	}
	return true
}

// TakeSnapshot cuts a snapshot of a volume directly in the backend, without a
// CSI call, as a test that plays the external-snapshotter does. It is
// idempotent by name like CreateSnapshot.
func (b *Backend) TakeSnapshot(name, volumeID string) (Snapshot, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s, err := b.createSnapshotLocked(name, volumeID, nil)
	if err != nil {
		return Snapshot{}, err
	}
	b.snapshotReadyLocked(s, false)
	return s.clone(), nil
}

// snapshotByNameLocked finds a snapshot by the name it was created with;
// members of group snapshots have none. The caller holds b.mu.
func (b *Backend) snapshotByNameLocked(name string) *Snapshot {
	for _, s := range b.snapshots {
		if s.GroupSnapshotID == "" && s.Name == name {
			return s
		}
	}
	return nil
}

// createSnapshotLocked cuts a snapshot, or returns the existing one of that
// name when it is of the same volume. The caller holds b.mu.
func (b *Backend) createSnapshotLocked(name, volumeID string, params map[string]string) (*Snapshot, error) {
	if s := b.snapshotByNameLocked(name); s != nil {
		if s.SourceVolumeID != volumeID {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %q exists as %s of volume %s", name, s.ID, s.SourceVolumeID)
		}
		return s, nil
	}
	v, ok := b.volumes[volumeID]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "source volume %s does not exist", volumeID)
	}
	return b.newSnapshotLocked(name, v, params, "", time.Now()), nil
}

// newSnapshotLocked records a new snapshot of v. The caller holds b.mu.
func (b *Backend) newSnapshotLocked(name string, v *Volume, params map[string]string, groupID string, now time.Time) *Snapshot {
	b.lastSnapshotID++
	s := &Snapshot{
		ID:              fmt.Sprintf("%s%0*d", snapshotIDPrefix, volumeIDDigits, b.lastSnapshotID),
		Name:            name,
		SourceVolumeID:  v.ID,
		SizeBytes:       v.CapacityBytes,
		CreationTime:    now,
		Parameters:      maps.Clone(params),
		GroupSnapshotID: groupID,
	}
	b.snapshots[s.ID] = s
	return s
}

// checkName validates the name of a create request.
func checkName(name string) error {
	switch {
	case name == "":
		return status.Error(codes.InvalidArgument, "name is required")
	case len(name) > maxNameLength:
		return status.Errorf(codes.InvalidArgument, "name is longer than %d bytes", maxNameLength)
	}
	return nil
}

func (s *controllerServer) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	spec := s.spec(MethodCreateSnapshot, req)
	spec.volumeID, spec.snapshotName = req.GetSourceVolumeId(), req.GetName()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT); err != nil {
		return nil, err
	}
	if err := checkName(spec.snapshotName); err != nil {
		return nil, s.b.reject(spec, err)
	}
	if spec.volumeID == "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "source_volume_id is required"))
	}
	params := maps.Clone(req.GetParameters())
	return runOp(ctx, s.b, spec, func(call *Call) (*csi.CreateSnapshotResponse, error) {
		snap, err := s.b.createSnapshotLocked(spec.snapshotName, spec.volumeID, params)
		if err != nil {
			return nil, err
		}
		call.SnapshotID = snap.ID
		return &csi.CreateSnapshotResponse{Snapshot: s.b.snapshotToCSILocked(snap, true)}, nil
	})
}

func (s *controllerServer) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	spec := s.spec(MethodDeleteSnapshot, req)
	spec.snapshotID = req.GetSnapshotId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT); err != nil {
		return nil, err
	}
	if spec.snapshotID == "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "snapshot_id is required"))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.DeleteSnapshotResponse, error) {
		snap, ok := s.b.snapshots[spec.snapshotID]
		if !ok {
			// Deleting a snapshot that is gone is success, as for
			// volumes.
			return &csi.DeleteSnapshotResponse{}, nil
		}
		if snap.GroupSnapshotID != "" {
			return nil, status.Errorf(codes.InvalidArgument, "snapshot %s is a member of group snapshot %s and goes only with DeleteVolumeGroupSnapshot", snap.ID, snap.GroupSnapshotID)
		}
		delete(s.b.snapshots, snap.ID)
		return &csi.DeleteSnapshotResponse{}, nil
	})
}

func (s *controllerServer) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (*csi.GetSnapshotResponse, error) {
	spec := s.spec(MethodGetSnapshot, req)
	spec.snapshotID = req.GetSnapshotId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_GET_SNAPSHOT); err != nil {
		return nil, err
	}
	if spec.snapshotID == "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "snapshot_id is required"))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.GetSnapshotResponse, error) {
		snap, ok := s.b.snapshots[spec.snapshotID]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "snapshot %s does not exist", spec.snapshotID)
		}
		return &csi.GetSnapshotResponse{Snapshot: s.b.snapshotToCSILocked(snap, true)}, nil
	})
}

// isSnapshotToken reports whether token has the form of the tokens
// ListSnapshots hands out: the id of the first snapshot of the next page.
func isSnapshotToken(token string) bool {
	digits, ok := strings.CutPrefix(token, snapshotIDPrefix)
	if !ok || len(digits) != volumeIDDigits {
		return false
	}
	return strings.Trim(digits, "0123456789") == ""
}

func (s *controllerServer) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	spec := s.spec(MethodListSnapshots, req)
	spec.volumeID, spec.snapshotID = req.GetSourceVolumeId(), req.GetSnapshotId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS); err != nil {
		return nil, err
	}
	maxEntries, token := int(req.GetMaxEntries()), req.GetStartingToken()
	switch {
	case maxEntries < 0:
		return nil, s.b.reject(spec, status.Errorf(codes.InvalidArgument, "negative max_entries %d", maxEntries))
	case token != "" && !isSnapshotToken(token):
		return nil, s.b.reject(spec, status.Errorf(codes.Aborted, "starting_token %q was not issued by this driver", token))
	}
	byID, bySource := spec.snapshotID, spec.volumeID
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ListSnapshotsResponse, error) {
		var ids []string
		for _, id := range slices.Sorted(maps.Keys(s.b.snapshots)) {
			snap := s.b.snapshots[id]
			if (byID == "" || id == byID) && (bySource == "" || snap.SourceVolumeID == bySource) {
				ids = append(ids, id)
			}
		}
		start, _ := slices.BinarySearch(ids, token)
		end := len(ids)
		if maxEntries > 0 {
			end = min(end, start+maxEntries)
		}
		rsp := &csi.ListSnapshotsResponse{}
		for _, id := range ids[start:end] {
			rsp.Entries = append(rsp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: s.b.snapshotToCSILocked(s.b.snapshots[id], true)})
		}
		if end < len(ids) {
			rsp.NextToken = ids[end]
		}
		return rsp, nil
	})
}
