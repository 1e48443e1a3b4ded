package testdriver

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// GroupSnapshot is the backend's record of one volume group snapshot. Its
// members are ordinary snapshots (see Backend.Snapshots) whose
// GroupSnapshotID is the group's ID. Values returned by Backend methods are
// copies.
type GroupSnapshot struct {
	ID string
	// Name is the name CreateVolumeGroupSnapshot (or TakeGroupSnapshot) was
	// given.
	Name string
	// SourceVolumeIDs are the snapshotted volumes, in request order.
	SourceVolumeIDs []string
	// SnapshotIDs are the member snapshots, one per source volume, in the
	// same order.
	SnapshotIDs  []string
	CreationTime time.Time
	Parameters   map[string]string
	// ReadyToUse is what the driver reports now: whether every member is
	// ready to use.
	ReadyToUse bool
}

// Group snapshot ids are groupSnapshotIDPrefix followed by volumeIDDigits
// digits.
const groupSnapshotIDPrefix = "group-"

func (g *GroupSnapshot) clone() GroupSnapshot {
	c := *g
	c.SourceVolumeIDs = slices.Clone(g.SourceVolumeIDs)
	c.SnapshotIDs = slices.Clone(g.SnapshotIDs)
	c.Parameters = maps.Clone(g.Parameters)
	return c
}

// GroupSnapshots returns a copy of every group snapshot, sorted by id.
func (b *Backend) GroupSnapshots() []GroupSnapshot {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]GroupSnapshot, 0, len(b.groupSnapshots))
	for _, id := range slices.Sorted(maps.Keys(b.groupSnapshots)) {
		out = append(out, b.groupCopyLocked(b.groupSnapshots[id]))
	}
	return out
}

// GroupSnapshot returns a copy of the group snapshot with the given id.
func (b *Backend) GroupSnapshot(id string) (GroupSnapshot, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	g, ok := b.groupSnapshots[id]
	if !ok {
		return GroupSnapshot{}, false
	}
	return b.groupCopyLocked(g), true
}

// TakeGroupSnapshot cuts a group snapshot of volumes directly in the backend,
// without a CSI call. It is idempotent by name like
// CreateVolumeGroupSnapshot.
func (b *Backend) TakeGroupSnapshot(name string, volumeIDs []string) (GroupSnapshot, error) {
	if err := checkGroupArgs(name, volumeIDs); err != nil {
		return GroupSnapshot{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	g, err := b.createGroupSnapshotLocked(name, volumeIDs, nil)
	if err != nil {
		return GroupSnapshot{}, err
	}
	return b.groupCopyLocked(g), nil
}

// groupCopyLocked copies g with its readiness as of now. The caller holds
// b.mu.
func (b *Backend) groupCopyLocked(g *GroupSnapshot) GroupSnapshot {
	c := g.clone()
	c.ReadyToUse = b.groupReadyLocked(g, false)
	return c
}

// groupReadyLocked says whether every member of g is ready; report is as for
// snapshotReadyLocked and counts for every member. The caller holds b.mu.
func (b *Backend) groupReadyLocked(g *GroupSnapshot, report bool) bool {
	ready := true
	for _, id := range g.SnapshotIDs {
		if s, ok := b.snapshots[id]; !ok || !b.snapshotReadyLocked(s, report) {
			ready = false
		}
	}
	return ready
}

// groupToCSILocked describes g for an answer. The caller holds b.mu.
func (b *Backend) groupToCSILocked(g *GroupSnapshot) *csi.VolumeGroupSnapshot {
	out := &csi.VolumeGroupSnapshot{
		GroupSnapshotId: g.ID,
		CreationTime:    timestamppb.New(g.CreationTime),
		ReadyToUse:      true,
	}
	for _, id := range g.SnapshotIDs {
		s, ok := b.snapshots[id]
		if !ok {
			// Members only go with their group; kept for safety.
			out.ReadyToUse = false
			continue
		}
		snap := b.snapshotToCSILocked(s, true)
		out.ReadyToUse = out.ReadyToUse && snap.GetReadyToUse()
		out.Snapshots = append(out.Snapshots, snap)
	}
	return out
}

// groupSnapshotByNameLocked finds a group snapshot by the name it was
// created with. The caller holds b.mu.
func (b *Backend) groupSnapshotByNameLocked(name string) *GroupSnapshot {
	for _, g := range b.groupSnapshots {
		if g.Name == name {
			return g
		}
	}
	return nil
}

// sameMembers reports whether two id lists hold the same ids, in any order.
func sameMembers(a, b []string) bool {
	return slices.Equal(slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)))
}

// checkGroupArgs validates what CreateVolumeGroupSnapshot is asked for.
func checkGroupArgs(name string, volumeIDs []string) error {
	if err := checkName(name); err != nil {
		return err
	}
	if len(volumeIDs) == 0 {
		return status.Error(codes.InvalidArgument, "source_volume_ids is required")
	}
	seen := map[string]bool{}
	for _, id := range volumeIDs {
		switch {
		case id == "":
			return status.Error(codes.InvalidArgument, "source_volume_ids holds an empty id")
		case seen[id]:
			return status.Errorf(codes.InvalidArgument, "source_volume_ids holds %s twice", id)
		}
		seen[id] = true
	}
	return nil
}

// createGroupSnapshotLocked cuts a group snapshot, all members at one instant,
// or returns the existing one of that name when it has the same source
// volumes and parameters. Nothing is cut unless every volume exists. The
// caller holds b.mu.
func (b *Backend) createGroupSnapshotLocked(name string, volumeIDs []string, params map[string]string) (*GroupSnapshot, error) {
	if g := b.groupSnapshotByNameLocked(name); g != nil {
		switch {
		case !sameMembers(g.SourceVolumeIDs, volumeIDs):
			return nil, status.Errorf(codes.AlreadyExists, "group snapshot %q exists as %s of volumes %v", name, g.ID, g.SourceVolumeIDs)
		case !maps.Equal(g.Parameters, params):
			return nil, status.Errorf(codes.AlreadyExists, "group snapshot %q exists as %s with other parameters", name, g.ID)
		}
		return g, nil
	}
	volumes := make([]*Volume, 0, len(volumeIDs))
	for _, id := range volumeIDs {
		v, ok := b.volumes[id]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "source volume %s does not exist", id)
		}
		volumes = append(volumes, v)
	}
	b.lastGroupID++
	g := &GroupSnapshot{
		ID:              fmt.Sprintf("%s%0*d", groupSnapshotIDPrefix, volumeIDDigits, b.lastGroupID),
		Name:            name,
		SourceVolumeIDs: slices.Clone(volumeIDs),
		CreationTime:    time.Now(),
		Parameters:      maps.Clone(params),
	}
	for _, v := range volumes {
		s := b.newSnapshotLocked("", v, params, g.ID, g.CreationTime)
		g.SnapshotIDs = append(g.SnapshotIDs, s.ID)
	}
	b.groupSnapshots[g.ID] = g
	return g, nil
}

// checkMembers returns InvalidArgument when the snapshot ids a CO sent do not
// name the members of g, as the CSI spec asks of a plugin that can tell.
func checkMembers(g *GroupSnapshot, snapshotIDs []string) error {
	if !sameMembers(g.SnapshotIDs, snapshotIDs) {
		return status.Errorf(codes.InvalidArgument, "snapshot_ids %v do not match the members %v of group snapshot %s", snapshotIDs, g.SnapshotIDs, g.ID)
	}
	return nil
}

// groupControllerServer serves CSI GroupController: volume group snapshots,
// with the same operation model as the Controller service.
type groupControllerServer struct {
	csi.UnimplementedGroupControllerServer
	*endpoint
}

// unadvertised journals and returns Unimplemented when group snapshots are
// switched off (see Config.DisableGroupController).
func (s *groupControllerServer) unadvertised(spec opSpec) error {
	if !s.b.groupControllerEnabled() {
		return s.b.reject(spec, status.Error(codes.Unimplemented, "the group controller service is not served: it needs capability CREATE_DELETE_SNAPSHOT and DisableGroupController unset"))
	}
	return nil
}

func (s *groupControllerServer) GroupControllerGetCapabilities(ctx context.Context, _ *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	spec := s.spec(MethodGroupControllerGetCapabilities, nil)
	if err := s.unadvertised(spec); err != nil {
		return nil, err
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.GroupControllerGetCapabilitiesResponse, error) {
		return &csi.GroupControllerGetCapabilitiesResponse{Capabilities: []*csi.GroupControllerServiceCapability{{
			Type: &csi.GroupControllerServiceCapability_Rpc{Rpc: &csi.GroupControllerServiceCapability_RPC{
				Type: csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT,
			}},
		}}}, nil
	})
}

func (s *groupControllerServer) CreateVolumeGroupSnapshot(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	spec := s.spec(MethodCreateVolumeGroupSnapshot, req)
	spec.groupSnapshotName, spec.sourceVolumeIDs = req.GetName(), slices.Clone(req.GetSourceVolumeIds())
	if err := s.unadvertised(spec); err != nil {
		return nil, err
	}
	if err := checkGroupArgs(spec.groupSnapshotName, spec.sourceVolumeIDs); err != nil {
		return nil, s.b.reject(spec, err)
	}
	params := maps.Clone(req.GetParameters())
	return runOp(ctx, s.b, spec, func(call *Call) (*csi.CreateVolumeGroupSnapshotResponse, error) {
		g, err := s.b.createGroupSnapshotLocked(spec.groupSnapshotName, spec.sourceVolumeIDs, params)
		if err != nil {
			return nil, err
		}
		call.GroupSnapshotID, call.SnapshotIDs = g.ID, joinList(g.SnapshotIDs)
		return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: s.b.groupToCSILocked(g)}, nil
	})
}

func (s *groupControllerServer) DeleteVolumeGroupSnapshot(ctx context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
	spec := s.spec(MethodDeleteVolumeGroupSnapshot, req)
	spec.groupSnapshotID, spec.snapshotIDs = req.GetGroupSnapshotId(), slices.Clone(req.GetSnapshotIds())
	if err := s.unadvertised(spec); err != nil {
		return nil, err
	}
	if spec.groupSnapshotID == "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "group_snapshot_id is required"))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
		g, ok := s.b.groupSnapshots[spec.groupSnapshotID]
		if !ok {
			// Gone (with its members) is success, as for volumes.
			return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
		}
		if err := checkMembers(g, spec.snapshotIDs); err != nil {
			return nil, err
		}
		for _, id := range g.SnapshotIDs {
			delete(s.b.snapshots, id)
		}
		delete(s.b.groupSnapshots, g.ID)
		return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
	})
}

func (s *groupControllerServer) GetVolumeGroupSnapshot(ctx context.Context, req *csi.GetVolumeGroupSnapshotRequest) (*csi.GetVolumeGroupSnapshotResponse, error) {
	spec := s.spec(MethodGetVolumeGroupSnapshot, req)
	spec.groupSnapshotID, spec.snapshotIDs = req.GetGroupSnapshotId(), slices.Clone(req.GetSnapshotIds())
	if err := s.unadvertised(spec); err != nil {
		return nil, err
	}
	if spec.groupSnapshotID == "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "group_snapshot_id is required"))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.GetVolumeGroupSnapshotResponse, error) {
		g, ok := s.b.groupSnapshots[spec.groupSnapshotID]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "group snapshot %s does not exist", spec.groupSnapshotID)
		}
		// An empty list is not checked: reading needs no member list.
		if len(spec.snapshotIDs) > 0 {
			if err := checkMembers(g, spec.snapshotIDs); err != nil {
				return nil, err
			}
		}
		return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: s.b.groupToCSILocked(g)}, nil
	})
}
