package testdriver

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// controllerServer serves CSI Controller. Handlers check arguments at once
// (journaled as calls that end immediately, since a cloud API also rejects a
// malformed request before doing anything) and leave every state-dependent
// decision to the backend operation, which sees the state as it is when the
// operation ends.
type controllerServer struct {
	csi.UnimplementedControllerServer
	*endpoint
}

// unadvertised journals and returns Unimplemented when the Controller service
// or the capability an RPC needs is switched off; rpc UNKNOWN means the RPC
// only needs the service.
func (s *controllerServer) unadvertised(spec opSpec, rpc csi.ControllerServiceCapability_RPC_Type) error {
	switch {
	case s.b.cfg.DisableControllerService:
		return s.b.reject(spec, status.Error(codes.Unimplemented, "the controller service is disabled"))
	case rpc != csi.ControllerServiceCapability_RPC_UNKNOWN && !s.b.hasCapability(rpc):
		return s.b.reject(spec, status.Errorf(codes.Unimplemented, "%s needs capability %s, which is not advertised", spec.method, rpc))
	}
	return nil
}

func (s *controllerServer) ControllerGetCapabilities(ctx context.Context, _ *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	spec := s.spec(MethodControllerGetCapabilities, nil)
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_UNKNOWN); err != nil {
		return nil, err
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ControllerGetCapabilitiesResponse, error) {
		caps := make([]*csi.ControllerServiceCapability, 0, len(s.b.cfg.ControllerCapabilities))
		for _, c := range s.b.cfg.ControllerCapabilities {
			caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
				Rpc: &csi.ControllerServiceCapability_RPC{Type: c},
			}})
		}
		return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
	})
}

func (s *controllerServer) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	spec := s.spec(MethodCreateVolume, req)
	spec.volumeName = req.GetName()
	for _, t := range req.GetAccessibilityRequirements().GetRequisite() {
		var pairs []string
		for _, k := range slices.Sorted(maps.Keys(t.GetSegments())) {
			pairs = append(pairs, k+"="+t.GetSegments()[k])
		}
		spec.requisite = append(spec.requisite, strings.Join(pairs, ","))
	}
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME); err != nil {
		return nil, err
	}
	args, err := s.b.parseCreate(req)
	if err != nil {
		return nil, s.b.reject(spec, err)
	}
	return runOp(ctx, s.b, spec, func(call *Call) (*csi.CreateVolumeResponse, error) {
		v, err := s.b.createLocked(args)
		if err != nil {
			return nil, err
		}
		call.VolumeID = v.ID
		return &csi.CreateVolumeResponse{Volume: v.toCSI()}, nil
	})
}

func (s *controllerServer) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	spec := s.spec(MethodDeleteVolume, req)
	spec.volumeID = req.GetVolumeId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME); err != nil {
		return nil, err
	}
	if spec.volumeID == "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "volume_id is required"))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.DeleteVolumeResponse, error) {
		v, ok := s.b.volumes[spec.volumeID]
		if !ok {
			// Deleting a volume that is gone is success: the CO may be
			// retrying a delete whose answer it missed.
			return &csi.DeleteVolumeResponse{}, nil
		}
		if len(v.Published) > 0 {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still published to %d node(s)", v.ID, len(v.Published))
		}
		delete(s.b.volumes, v.ID)
		delete(s.b.health, v.ID)
		return &csi.DeleteVolumeResponse{}, nil
	})
}

func (s *controllerServer) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	spec := s.spec(MethodControllerExpandVolume, req)
	spec.volumeID = req.GetVolumeId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_EXPAND_VOLUME); err != nil {
		return nil, err
	}
	required, limit := req.GetCapacityRange().GetRequiredBytes(), req.GetCapacityRange().GetLimitBytes()
	if err := checkExpandArgs(spec.volumeID, required, limit); err != nil {
		return nil, s.b.reject(spec, err)
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ControllerExpandVolumeResponse, error) {
		v, ok := s.b.volumes[spec.volumeID]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist", spec.volumeID)
		}
		if limit > 0 && v.CapacityBytes > limit {
			return nil, status.Errorf(codes.OutOfRange, "volume %s already has %d bytes, more than limit %d; shrinking is not supported", v.ID, v.CapacityBytes, limit)
		}
		if grow := required - v.CapacityBytes; grow > 0 {
			if free := s.b.cfg.TotalCapacity - s.b.usedCapacityLocked(); grow > free {
				return nil, status.Errorf(codes.ResourceExhausted, "growing volume %s by %d bytes, only %d free", v.ID, grow, free)
			}
			v.CapacityBytes = required
		}
		// The backend grows the device; whether a file system must still be
		// grown on the node is the test's choice.
		return &csi.ControllerExpandVolumeResponse{
			CapacityBytes:         v.CapacityBytes,
			NodeExpansionRequired: s.b.nodeExpansionRequiredLocked(v.ID),
		}, nil
	})
}

// checkExpandArgs validates a ControllerExpandVolume request.
func checkExpandArgs(volumeID string, required, limit int64) error {
	switch {
	case volumeID == "":
		return status.Error(codes.InvalidArgument, "volume_id is required")
	case required == 0 && limit == 0:
		return status.Error(codes.InvalidArgument, "capacity_range is required")
	}
	return checkCapacityRange(required, limit)
}

// checkCapacityRange validates the numbers of a capacity range.
func checkCapacityRange(required, limit int64) error {
	switch {
	case required < 0 || limit < 0:
		return status.Errorf(codes.InvalidArgument, "negative capacity range: required %d, limit %d", required, limit)
	case limit > 0 && required > limit:
		return status.Errorf(codes.InvalidArgument, "required_bytes %d exceeds limit_bytes %d", required, limit)
	}
	return nil
}

func (s *controllerServer) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (*csi.ControllerModifyVolumeResponse, error) {
	spec := s.spec(MethodControllerModifyVolume, req)
	spec.volumeID = req.GetVolumeId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_MODIFY_VOLUME); err != nil {
		return nil, err
	}
	params := req.GetMutableParameters()
	switch {
	case spec.volumeID == "":
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "volume_id is required"))
	case len(params) == 0:
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "mutable_parameters is required"))
	}
	if err := s.b.checkMutableParameters(params); err != nil {
		return nil, s.b.reject(spec, err)
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ControllerModifyVolumeResponse, error) {
		v, ok := s.b.volumes[spec.volumeID]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist", spec.volumeID)
		}
		if v.MutableParameters == nil {
			v.MutableParameters = map[string]string{}
		}
		for k, val := range params {
			v.MutableParameters[k] = val
		}
		return &csi.ControllerModifyVolumeResponse{}, nil
	})
}

// checkMutableParameters rejects keys the backend cannot change.
func (b *Backend) checkMutableParameters(params map[string]string) error {
	for k := range params {
		if !slices.Contains(b.cfg.MutableParameters, k) {
			return status.Errorf(codes.InvalidArgument, "mutable parameter %q is not supported (supported: %v)", k, b.cfg.MutableParameters)
		}
	}
	return nil
}

// checkCapability says why the driver cannot provide a volume capability, or
// returns "" when it can.
func (b *Backend) checkCapability(c *csi.VolumeCapability) string {
	if c.GetBlock() == nil && c.GetMount() == nil {
		return "volume capability needs access type block or mount"
	}
	switch m := c.GetAccessMode().GetMode(); m {
	case csi.VolumeCapability_AccessMode_UNKNOWN:
		return "volume capability needs an access mode"
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		if !b.hasCapability(csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER) {
			return fmt.Sprintf("access mode %s needs capability SINGLE_NODE_MULTI_WRITER", m)
		}
	}
	return ""
}

// isSingleNode reports whether an access mode allows only one node at a time.
func isSingleNode(m csi.VolumeCapability_AccessMode_Mode) bool {
	switch m {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		return true
	}
	return false
}
