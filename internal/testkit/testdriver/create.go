package testdriver

import (
	"maps"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// createArgs is what CreateVolume needs from its request, copied out so that
// the backend operation does not hold on to the request.
type createArgs struct {
	name              string
	size              int64
	required, limit   int64
	parameters        map[string]string
	mutableParameters map[string]string
	source            *csi.VolumeContentSource
	topology          []*csi.Topology
}

// maxNameLength is the longest volume name accepted, the CSI spec's limit on
// string fields.
const maxNameLength = 128

// parseCreate validates a CreateVolume request.
func (b *Backend) parseCreate(req *csi.CreateVolumeRequest) (createArgs, error) {
	a := createArgs{
		name:              req.GetName(),
		required:          req.GetCapacityRange().GetRequiredBytes(),
		limit:             req.GetCapacityRange().GetLimitBytes(),
		parameters:        maps.Clone(req.GetParameters()),
		mutableParameters: maps.Clone(req.GetMutableParameters()),
	}
	switch {
	case a.name == "":
		return a, status.Error(codes.InvalidArgument, "name is required")
	case len(a.name) > maxNameLength:
		return a, status.Errorf(codes.InvalidArgument, "name is longer than %d bytes", maxNameLength)
	case len(req.GetVolumeCapabilities()) == 0:
		return a, status.Error(codes.InvalidArgument, "volume_capabilities is required")
	}
	for _, c := range req.GetVolumeCapabilities() {
		if problem := b.checkCapability(c); problem != "" {
			return a, status.Error(codes.InvalidArgument, problem)
		}
	}
	if err := checkCapacityRange(a.required, a.limit); err != nil {
		return a, err
	}
	if err := b.checkMutableParameters(a.mutableParameters); err != nil {
		return a, err
	}
	a.size = a.required
	if a.size == 0 {
		a.size = DefaultVolumeSize
		if a.limit > 0 {
			a.size = min(a.size, a.limit)
		}
	}
	if src := req.GetVolumeContentSource(); src != nil {
		switch {
		case src.GetVolume() != nil && b.hasCapability(csi.ControllerServiceCapability_RPC_CLONE_VOLUME):
			a.source = proto.Clone(src).(*csi.VolumeContentSource)
		case src.GetVolume() != nil:
			return a, status.Error(codes.InvalidArgument, "cloning volumes needs capability CLONE_VOLUME, which is not advertised")
		case src.GetSnapshot() != nil && b.hasCapability(csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT):
			a.source = proto.Clone(src).(*csi.VolumeContentSource)
		case src.GetSnapshot() != nil:
			return a, status.Error(codes.InvalidArgument, "restoring snapshots needs capability CREATE_DELETE_SNAPSHOT, which is not advertised")
		default:
			return a, status.Error(codes.InvalidArgument, "volume_content_source names neither a volume nor a snapshot")
		}
	}
	a.topology = b.volumeTopology(req.GetAccessibilityRequirements())
	return a, nil
}

// volumeTopology picks where a new volume is accessible: the first preferred
// or else the first requisite segment, or else the driver's node.
func (b *Backend) volumeTopology(req *csi.TopologyRequirement) []*csi.Topology {
	if !b.cfg.Topology {
		return nil
	}
	for _, list := range [][]*csi.Topology{req.GetPreferred(), req.GetRequisite()} {
		if len(list) > 0 {
			return []*csi.Topology{proto.Clone(list[0]).(*csi.Topology)}
		}
	}
	return []*csi.Topology{{Segments: map[string]string{TopologyKey: b.cfg.NodeID}}}
}

// createLocked creates the volume, or returns the existing one of that name
// when it matches the request. The caller holds b.mu.
func (b *Backend) createLocked(a createArgs) (*Volume, error) {
	if v := b.volumeByNameLocked(a.name); v != nil {
		if err := a.conflict(v); err != nil {
			return nil, err
		}
		return v, nil
	}
	size, err := b.sizeFromSourceLocked(a)
	if err != nil {
		return nil, err
	}
	if free := b.cfg.TotalCapacity - b.usedCapacityLocked(); size > free {
		return nil, status.Errorf(codes.ResourceExhausted, "volume of %d bytes requested, only %d free", size, free)
	}
	v := &Volume{
		ID:                 b.newIDLocked(),
		Name:               a.name,
		CapacityBytes:      size,
		Parameters:         a.parameters,
		MutableParameters:  a.mutableParameters,
		VolumeContext:      maps.Clone(a.parameters),
		ContentSource:      a.source,
		AccessibleTopology: a.topology,
		Published:          map[string]bool{},
	}
	b.volumes[v.ID] = v
	return v, nil
}

// conflict returns AlreadyExists when the existing volume v of the same name
// does not satisfy the request, as the CSI spec demands.
func (a createArgs) conflict(v *Volume) error {
	switch {
	case v.CapacityBytes < a.required || (a.limit > 0 && v.CapacityBytes > a.limit):
		return status.Errorf(codes.AlreadyExists, "volume %q exists as %s with %d bytes, outside the requested range", a.name, v.ID, v.CapacityBytes)
	case !maps.Equal(v.Parameters, a.parameters):
		return status.Errorf(codes.AlreadyExists, "volume %q exists as %s with other parameters", a.name, v.ID)
	case !proto.Equal(v.ContentSource, a.source):
		return status.Errorf(codes.AlreadyExists, "volume %q exists as %s with another content source", a.name, v.ID)
	}
	return nil
}

// sizeFromSourceLocked is the size of a new volume: what was asked for, or
// the size of the volume or snapshot it is made from when that is larger. The
// source must exist. The caller holds b.mu.
func (b *Backend) sizeFromSourceLocked(a createArgs) (int64, error) {
	var what, id string
	var sourceSize int64
	switch {
	case a.source.GetVolume() != nil:
		what, id = "volume", a.source.GetVolume().GetVolumeId()
		from, ok := b.volumes[id]
		if !ok {
			return 0, status.Errorf(codes.NotFound, "source volume %s does not exist", id)
		}
		sourceSize = from.CapacityBytes
	case a.source.GetSnapshot() != nil:
		what, id = "snapshot", a.source.GetSnapshot().GetSnapshotId()
		from, ok := b.snapshots[id]
		if !ok {
			return 0, status.Errorf(codes.NotFound, "source snapshot %s does not exist", id)
		}
		sourceSize = from.SizeBytes
	default:
		return a.size, nil
	}
	if sourceSize <= a.size {
		return a.size, nil
	}
	if a.limit > 0 && sourceSize > a.limit {
		return 0, status.Errorf(codes.OutOfRange, "source %s %s has %d bytes, more than limit %d", what, id, sourceSize, a.limit)
	}
	return sourceSize, nil
}
