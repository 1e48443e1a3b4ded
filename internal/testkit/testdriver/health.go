package testdriver

import (
	"context"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// HealthCondition is one adverse health condition of a volume, as ControllerGetVolumeHealth
// and ControllerListVolumeHealth report it (a VolumeHealthEntry of CSI spec v1.13+).
type HealthCondition struct {
	// Status is the condition's category; required, and not UNKNOWN_VOLUME_HEALTH_TYPE
	// unless a test wants to see what a CO makes of a type it does not know (any number
	// is accepted).
	Status csi.VolumeHealthErrorType
	// Reason is a brief CamelCase reason; required. (Status, Reason) is unique per volume.
	Reason string
	// Message is a description for users; optional.
	Message string
}

// SetVolumeHealth sets the adverse conditions the driver reports for a volume from now on,
// replacing the previous ones: none makes the volume healthy again. The conditions are
// reported in the order given. It fails for an unknown volume, a condition without a
// reason, or two conditions with the same status and reason, which the spec forbids. A
// volume's health goes with it when it is deleted.
func (b *Backend) SetVolumeHealth(volumeID string, conditions ...HealthCondition) error {
	type key struct {
		status csi.VolumeHealthErrorType
		reason string
	}
	seen := map[key]bool{}
	for _, c := range conditions {
		k := key{c.Status, c.Reason}
		switch {
		case c.Reason == "":
			return fmt.Errorf("health condition %s of volume %s without a reason", c.Status, volumeID)
		case seen[k]:
			return fmt.Errorf("two health conditions %s/%s for volume %s", c.Status, c.Reason, volumeID)
		}
		seen[k] = true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.volumes[volumeID]; !ok {
		return fmt.Errorf("volume %s does not exist", volumeID)
	}
	if len(conditions) == 0 {
		delete(b.health, volumeID)
		return nil
	}
	b.health[volumeID] = slices.Clone(conditions)
	return nil
}

// VolumeHealth returns the adverse conditions set for a volume; none when it is healthy
// or unknown.
func (b *Backend) VolumeHealth(volumeID string) []HealthCondition {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.health[volumeID])
}

// volumeHealthLocked describes one volume's health for the CSI answers. The caller holds
// b.mu.
func (b *Backend) volumeHealthLocked(id string) *csi.VolumeHealth {
	h := &csi.VolumeHealth{VolumeId: id}
	for _, c := range b.health[id] {
		h.HealthStatuses = append(h.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status: c.Status, Reason: c.Reason, Message: c.Message,
		})
	}
	return h
}

func (s *controllerServer) ControllerGetVolumeHealth(ctx context.Context, req *csi.ControllerGetVolumeHealthRequest) (*csi.ControllerGetVolumeHealthResponse, error) {
	spec := s.spec(MethodControllerGetVolumeHealth, req)
	spec.volumeID = req.GetVolumeId()
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH); err != nil {
		return nil, err
	}
	if spec.volumeID == "" {
		return nil, s.b.reject(spec, status.Error(codes.InvalidArgument, "volume_id is required"))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ControllerGetVolumeHealthResponse, error) {
		if _, ok := s.b.volumes[spec.volumeID]; !ok {
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist", spec.volumeID)
		}
		return &csi.ControllerGetVolumeHealthResponse{VolumeHealth: s.b.volumeHealthLocked(spec.volumeID)}, nil
	})
}

// ControllerListVolumeHealth lists the abnormal volumes only, as the spec has it, paged as
// ListVolumes is: a token is the id of the first volume of the next page, so a page
// boundary stays put when volumes before it are deleted or turn healthy between calls.
func (s *controllerServer) ControllerListVolumeHealth(ctx context.Context, req *csi.ControllerListVolumeHealthRequest) (*csi.ControllerListVolumeHealthResponse, error) {
	spec := s.spec(MethodControllerListVolumeHealth, req)
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH); err != nil {
		return nil, err
	}
	maxEntries, token := int(req.GetMaxEntries()), req.GetStartingToken()
	switch {
	case maxEntries < 0:
		return nil, s.b.reject(spec, status.Errorf(codes.InvalidArgument, "negative max_entries %d", maxEntries))
	case token != "" && !isListToken(token):
		return nil, s.b.reject(spec, status.Errorf(codes.Aborted, "starting_token %q was not issued by this driver", token))
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.ControllerListVolumeHealthResponse, error) {
		var ids []string
		for _, id := range s.b.sortedIDsLocked() {
			if len(s.b.health[id]) > 0 {
				ids = append(ids, id)
			}
		}
		start, _ := slices.BinarySearch(ids, token)
		end := len(ids)
		if maxEntries > 0 {
			end = min(end, start+maxEntries)
		}
		if s.b.cfg.HealthPageSize > 0 {
			end = min(end, start+s.b.cfg.HealthPageSize)
		}
		rsp := &csi.ControllerListVolumeHealthResponse{}
		for _, id := range ids[start:end] {
			rsp.Entries = append(rsp.Entries, s.b.volumeHealthLocked(id))
		}
		if end < len(ids) {
			rsp.NextToken = ids[end]
		}
		return rsp, nil
	})
}
