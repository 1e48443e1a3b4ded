package testdriver

import (
	"context"
	"maps"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// CapacityRule is one answer GetCapacity gives: for requests whose accessible
// topology contains Segment and whose parameters contain Parameters (nil
// matches any), the available capacity and, when non-zero, the maximum and
// minimum volume sizes.
type CapacityRule struct {
	Segment    map[string]string
	Parameters map[string]string

	AvailableCapacity int64
	// MaximumVolumeSize and MinimumVolumeSize are reported when non-zero.
	MaximumVolumeSize int64
	MinimumVolumeSize int64
}

func (r CapacityRule) matches(req *csi.GetCapacityRequest) bool {
	segments := req.GetAccessibleTopology().GetSegments()
	for k, v := range r.Segment {
		if segments[k] != v {
			return false
		}
	}
	for k, v := range r.Parameters {
		if got, ok := req.GetParameters()[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func (r CapacityRule) clone() CapacityRule {
	r.Segment = maps.Clone(r.Segment)
	r.Parameters = maps.Clone(r.Parameters)
	return r
}

// SetCapacityRules replaces the rules GetCapacity answers from (the first
// matching rule wins; with none matching it reports the free space of the
// pool). Calls that end afterwards see the new rules, as a storage system
// whose free space changes.
func (b *Backend) SetCapacityRules(rules []CapacityRule) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.capacityRules = cloneRules(rules)
}

func cloneRules(rules []CapacityRule) []CapacityRule {
	out := make([]CapacityRule, 0, len(rules))
	for _, r := range rules {
		out = append(out, r.clone())
	}
	return out
}

// capacityLocked answers GetCapacity. The caller holds b.mu.
func (b *Backend) capacityLocked(req *csi.GetCapacityRequest) *csi.GetCapacityResponse {
	i := slices.IndexFunc(b.capacityRules, func(r CapacityRule) bool { return r.matches(req) })
	if i < 0 {
		// One pool serves every topology segment and parameter set.
		return &csi.GetCapacityResponse{AvailableCapacity: b.cfg.TotalCapacity - b.usedCapacityLocked()}
	}
	r := b.capacityRules[i]
	rsp := &csi.GetCapacityResponse{AvailableCapacity: r.AvailableCapacity}
	if r.MaximumVolumeSize != 0 {
		rsp.MaximumVolumeSize = wrapperspb.Int64(r.MaximumVolumeSize)
	}
	if r.MinimumVolumeSize != 0 {
		rsp.MinimumVolumeSize = wrapperspb.Int64(r.MinimumVolumeSize)
	}
	return rsp
}

func (s *controllerServer) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	spec := s.spec(MethodGetCapacity, req)
	if err := s.unadvertised(spec, csi.ControllerServiceCapability_RPC_GET_CAPACITY); err != nil {
		return nil, err
	}
	return runOp(ctx, s.b, spec, func(*Call) (*csi.GetCapacityResponse, error) {
		return s.b.capacityLocked(req), nil
	})
}
