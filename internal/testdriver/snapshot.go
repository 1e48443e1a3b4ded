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
	ID             string
	Name           string
	SourceVolumeID string
	// SizeBytes is the size of the source volume when the snapshot was
	// taken; a volume restored from it is at least this large.
	SizeBytes    int64
	CreationTime time.Time
	Parameters   map[string]string
}

// Snapshot ids are snapshotIDPrefix followed by volumeIDDigits digits, so
// that string order is creation order (ListSnapshots tokens rely on it).
const snapshotIDPrefix = "snap-"

func (s *Snapshot) clone() Snapshot {
	c := *s
	c.Parameters = maps.Clone(s.Parameters)
	return c
}

func (s *Snapshot) toCSI() *csi.Snapshot {
	return &csi.Snapshot{
		SnapshotId:     s.ID,
		SourceVolumeId: s.SourceVolumeID,
		SizeBytes:      s.SizeBytes,
		CreationTime:   timestamppb.New(s.CreationTime),
		// The in-memory backend cuts snapshots at once.
		ReadyToUse: true,
	}
}

// Snapshots returns a copy of every snapshot, sorted by id.
func (b *Backend) Snapshots() []Snapshot {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]Snapshot, 0, len(b.snapshots))
	for _, id := range slices.Sorted(maps.Keys(b.snapshots)) {
		out = append(out, b.snapshots[id].clone())
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
	return s.clone(), true
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
	return s.clone(), nil
}

// createSnapshotLocked cuts a snapshot, or returns the existing one of that
// name when it is of the same volume. The caller holds b.mu.
func (b *Backend) createSnapshotLocked(name, volumeID string, params map[string]string) (*Snapshot, error) {
	for _, s := range b.snapshots {
		if s.Name != name {
			continue
		}
		if s.SourceVolumeID != volumeID {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %q exists as %s of volume %s", name, s.ID, s.SourceVolumeID)
		}
		return s, nil
	}
	v, ok := b.volumes[volumeID]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "source volume %s does not exist", volumeID)
	}
	b.lastSnapshotID++
	s := &Snapshot{
		ID:             fmt.Sprintf("%s%0*d", snapshotIDPrefix, volumeIDDigits, b.lastSnapshotID),
		Name:           name,
		SourceVolumeID: v.ID,
		SizeBytes:      v.CapacityBytes,
		CreationTime:   time.Now(),
		Parameters:     maps.Clone(params),
	}
	b.snapshots[s.ID] = s
	return s, nil
}

func (s *controllerServer) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	spec := s.spec(MethodCreateSnapshot)
	spec.volumeID = req.GetSourceVolumeId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT); err != nil {
		return nil, err
	}
	switch {
	case req.GetName() == "":
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "name is required"))
	case len(req.GetName()) > maxNameLength:
		return nil, s.b.reject(spec, status.Errorf(codes.InvalidArgument, "name is longer than %d bytes", maxNameLength))
	case spec.volumeID == "":
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "source_volume_id is required"))
	}
	name, params := req.GetName(), maps.Clone(req.GetParameters())
	return runOp(ctx, s.b, spec, func(*Call) (*csi.CreateSnapshotResponse, error) {
		snap, err := s.b.createSnapshotLocked(name, spec.volumeID, params)
		if err != nil {
			return nil, err
		}
		return &csi.CreateSnapshotResponse{Snapshot: snap.toCSI()}, nil
	})
}

func (s *controllerServer) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	spec := s.spec(MethodDeleteSnapshot)
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT); err != nil {
		return nil, err
	}
	id := req.GetSnapshotId()
	if id == "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "snapshot_id is required"))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.DeleteSnapshotResponse, error) {
		// Deleting a snapshot that is gone is success, as for volumes.
		delete(s.b.snapshots, id)
		return &csi.DeleteSnapshotResponse{}, nil
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
	spec := s.spec(MethodListSnapshots)
	spec.volumeID = req.GetSourceVolumeId()
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
	byID, bySource := req.GetSnapshotId(), req.GetSourceVolumeId()
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
			rsp.Entries = append(rsp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: s.b.snapshots[id].toCSI()})
		}
		if end < len(ids) {
			rsp.NextToken = ids[end]
		}
		return rsp, nil
	})
}
