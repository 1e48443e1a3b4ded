package testdriver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// nodeServer is a minimal CSI Node service. The sidecars under test never
// call it; it exists because the csi-sanity Controller tests ask NodeGetInfo
// for a node id and clean up with NodeUnpublishVolume. Stage and publish just
// succeed: there is no real device to mount.
type nodeServer struct {
	csi.UnimplementedNodeServer
	*endpoint
}

func (s *nodeServer) NodeGetInfo(ctx context.Context, _ *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	spec := s.spec(MethodNodeGetInfo, nil)
	spec.nodeID = s.b.cfg.NodeID
	return runOp(ctx, s.b, spec, func(*Call) (*csi.NodeGetInfoResponse, error) {
		rsp := &csi.NodeGetInfoResponse{NodeId: s.b.cfg.NodeID, MaxVolumesPerNode: s.b.cfg.MaxVolumesPerNode}
		if s.b.cfg.Topology {
			rsp.AccessibleTopology = &csi.Topology{Segments: map[string]string{TopologyKey: s.b.cfg.NodeID}}
		}
		return rsp, nil
	})
}

func (s *nodeServer) NodeGetCapabilities(ctx context.Context, _ *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	// No STAGE_UNSTAGE_VOLUME: staging would add nothing to a no-op node.
	return runOp(ctx, s.b, s.spec(MethodNodeGetCapabilities, nil), func(*Call) (*csi.NodeGetCapabilitiesResponse, error) {
		rsp := &csi.NodeGetCapabilitiesResponse{}
		if s.b.cfg.NodeExpansion {
			rsp.Capabilities = append(rsp.Capabilities, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{
				Rpc: &csi.NodeServiceCapability_RPC{Type: csi.NodeServiceCapability_RPC_EXPAND_VOLUME},
			}})
		}
		return rsp, nil
	})
}

func (s *nodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	spec := s.nodeSpec(MethodNodeStageVolume, req, req.GetVolumeId())
	if err := s.checkPaths(spec, req.GetStagingTargetPath(), "staging_target_path"); err != nil {
		return nil, err
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.NodeStageVolumeResponse, error) {
		return &csi.NodeStageVolumeResponse{}, nil
	})
}

func (s *nodeServer) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	spec := s.nodeSpec(MethodNodeUnstageVolume, req, req.GetVolumeId())
	if err := s.checkPaths(spec, req.GetStagingTargetPath(), "staging_target_path"); err != nil {
		return nil, err
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.NodeUnstageVolumeResponse, error) {
		return &csi.NodeUnstageVolumeResponse{}, nil
	})
}

func (s *nodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	spec := s.nodeSpec(MethodNodePublishVolume, req, req.GetVolumeId())
	if err := s.checkPaths(spec, req.GetTargetPath(), "target_path"); err != nil {
		return nil, err
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.NodePublishVolumeResponse, error) {
		return &csi.NodePublishVolumeResponse{}, nil
	})
}

func (s *nodeServer) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	spec := s.nodeSpec(MethodNodeUnpublishVolume, req, req.GetVolumeId())
	if err := s.checkPaths(spec, req.GetTargetPath(), "target_path"); err != nil {
		return nil, err
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.NodeUnpublishVolumeResponse, error) {
		return &csi.NodeUnpublishVolumeResponse{}, nil
	})
}

// nodeSpec describes a node call about a volume on this driver's node.
func (s *nodeServer) nodeSpec(method string, req any, volumeID string) opSpec {
	spec := s.spec(method, req)
	spec.volumeID, spec.nodeID = volumeID, s.b.cfg.NodeID
	return spec
}

// checkPaths rejects a node call without a volume id or path.
func (s *nodeServer) checkPaths(spec opSpec, path, field string) error {
	switch {
	case spec.volumeID == "":
		return s.b.reject(spec, status.Error(codes.InvalidArgument, "volume_id is required"))
	case path == "":
		return s.b.reject(spec, status.Errorf(codes.InvalidArgument, "%s is required", field))
	}
	return nil
}
