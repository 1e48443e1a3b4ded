package testdriver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// PublishContextDevicePath is the publish_context key naming the device the
// backend "attached".
const PublishContextDevicePath = "devicePath"

func (s *controllerServer) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	spec := s.spec(MethodControllerPublishVolume, req)
	spec.volumeID, spec.nodeID = req.GetVolumeId(), req.GetNodeId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME); err != nil {
		return nil, err
	}
	readonly := req.GetReadonly()
	mode := req.GetVolumeCapability().GetAccessMode().GetMode()
	switch {
	case spec.volumeID == "":
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "volume_id is required"))
	case spec.nodeID == "":
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "node_id is required"))
	case req.GetVolumeCapability() == nil:
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "volume_capability is required"))
	}
	if problem := s.b.checkCapability(req.GetVolumeCapability()); problem != "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, problem))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ControllerPublishVolumeResponse, error) {
		if err := s.b.publishLocked(spec.volumeID, spec.nodeID, readonly, mode); err != nil {
			return nil, err
		}
		return &csi.ControllerPublishVolumeResponse{
			PublishContext: map[string]string{PublishContextDevicePath: "/dev/testdriver/" + spec.volumeID},
		}, nil
	})
}

// publishLocked attaches a volume to a node, checking what a cloud would. The
// caller holds b.mu.
func (b *Backend) publishLocked(volumeID, node string, readonly bool, mode csi.VolumeCapability_AccessMode_Mode) error {
	v, ok := b.volumes[volumeID]
	if !ok {
		return status.Errorf(codes.NotFound, "volume %s does not exist", volumeID)
	}
	if !b.nodeExists(node) {
		return status.Errorf(codes.NotFound, "node %s does not exist", node)
	}
	if ro, ok := v.Published[node]; ok {
		if ro != readonly {
			return status.Errorf(codes.AlreadyExists, "volume %s is already published to node %s with readonly=%t", volumeID, node, ro)
		}
		return nil
	}
	if isSingleNode(mode) && len(v.Published) > 0 {
		return status.Errorf(codes.FailedPrecondition, "volume %s with access mode %s is already published to another node", volumeID, mode)
	}
	if limit := b.cfg.MaxVolumesPerNode; limit > 0 && b.publishedToLocked(node) >= limit {
		return status.Errorf(codes.ResourceExhausted, "node %s already has the maximum of %d volumes", node, limit)
	}
	v.Published[node] = readonly
	return nil
}

// publishedToLocked counts the volumes published to node.
func (b *Backend) publishedToLocked(node string) int64 {
	var n int64
	for _, v := range b.volumes {
		if _, ok := v.Published[node]; ok {
			n++
		}
	}
	return n
}

func (s *controllerServer) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	spec := s.spec(MethodControllerUnpublishVolume, req)
	spec.volumeID, spec.nodeID = req.GetVolumeId(), req.GetNodeId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME); err != nil {
		return nil, err
	}
	if spec.volumeID == "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "volume_id is required"))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ControllerUnpublishVolumeResponse, error) {
		// An unknown volume or node counts as unpublished, so retries
		// succeed.
		if v, ok := s.b.volumes[spec.volumeID]; ok {
			if spec.nodeID == "" {
				// The spec's meaning of an empty node_id: unpublish
				// from every node.
				clear(v.Published)
			} else {
				delete(v.Published, spec.nodeID)
			}
		}
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	})
}
