package testdriver

import (
	"context"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Read-only Controller RPCs: they go through the backend (latency, faults,
// journal) but change nothing.

func (s *controllerServer) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	spec := s.spec(MethodValidateVolumeCapabilities, req)
	spec.volumeID = req.GetVolumeId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_UNKNOWN); err != nil {
		return nil, err
	}
	switch {
	case spec.volumeID == "":
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "volume_id is required"))
	case len(req.GetVolumeCapabilities()) == 0:
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "volume_capabilities is required"))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ValidateVolumeCapabilitiesResponse, error) {
		if _, ok := s.b.volumes[spec.volumeID]; !ok {
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist", spec.volumeID)
		}
		for _, c := range req.GetVolumeCapabilities() {
			if problem := s.b.checkCapability(c); problem != "" {
				return &csi.ValidateVolumeCapabilitiesResponse{Message: problem}, nil
			}
		}
		return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
			VolumeContext:      req.GetVolumeContext(),
			VolumeCapabilities: req.GetVolumeCapabilities(),
			Parameters:         req.GetParameters(),
			MutableParameters:  req.GetMutableParameters(),
		}}, nil
	})
}

// isListToken reports whether token has the form of the tokens ListVolumes
// hands out: the id of the first volume of the next page. Anything else was
// never issued by this driver.
func isListToken(token string) bool {
	digits, ok := strings.CutPrefix(token, volumeIDPrefix)
	if !ok || len(digits) != volumeIDDigits {
		return false
	}
	for _, r := range digits {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}

func (s *controllerServer) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	spec := s.spec(MethodListVolumes, req)
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_LIST_VOLUMES); err != nil {
		return nil, err
	}
	maxEntries, token := int(req.GetMaxEntries()), req.GetStartingToken()
	switch {
	case maxEntries < 0:
		return nil, s.b.reject(spec, status.Errorf(codes.InvalidArgument, "negative max_entries %d", maxEntries))
	case token != "" && !isListToken(token):
		return nil, s.b.reject(spec, status.Errorf(codes.Aborted, "starting_token %q was not issued by this driver", token))
	}
	withNodes := s.b.hasCapability(csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES)
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ListVolumesResponse, error) {
		ids := s.b.sortedIDsLocked()
		// Tokens are ids, not offsets, so a page boundary stays put when
		// volumes before it are deleted between calls.
		start, _ := slices.BinarySearch(ids, token)
		end := len(ids)
		if maxEntries > 0 {
			end = min(end, start+maxEntries)
		}
		rsp := &csi.ListVolumesResponse{}
		for _, id := range ids[start:end] {
			rsp.Entries = append(rsp.Entries, s.b.listEntryLocked(id, withNodes))
		}
		if end < len(ids) {
			rsp.NextToken = ids[end]
		}
		return rsp, nil
	})
}

// listEntryLocked describes one volume for ListVolumes.
func (b *Backend) listEntryLocked(id string, withNodes bool) *csi.ListVolumesResponse_Entry {
	v := b.volumes[id]
	e := &csi.ListVolumesResponse_Entry{Volume: v.toCSI()}
	if withNodes {
		e.Status = &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: publishedNodes(v)}
	}
	return e
}

// publishedNodes lists the nodes a volume is published to, sorted for stable
// answers.
func publishedNodes(v *Volume) []string {
	nodes := make([]string, 0, len(v.Published))
	for n := range v.Published {
		nodes = append(nodes, n)
	}
	slices.Sort(nodes)
	return nodes
}

func (s *controllerServer) ControllerGetVolume(ctx context.Context, req *csi.ControllerGetVolumeRequest) (*csi.ControllerGetVolumeResponse, error) {
	spec := s.spec(MethodControllerGetVolume, req)
	spec.volumeID = req.GetVolumeId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_GET_VOLUME); err != nil {
		return nil, err
	}
	if spec.volumeID == "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "volume_id is required"))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ControllerGetVolumeResponse, error) {
		v, ok := s.b.volumes[spec.volumeID]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist", spec.volumeID)
		}
		return &csi.ControllerGetVolumeResponse{
			Volume: v.toCSI(),
			Status: &csi.ControllerGetVolumeResponse_VolumeStatus{PublishedNodeIds: publishedNodes(v)},
		}, nil
	})
}
