package testdriver

import (
	"context"
	"maps"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// endpoint is what every service of one socket shares: the backend and the
// socket path the journal names.
type endpoint struct {
	b      *Backend
	socket string
}

// secretCarrier is a CSI request with a secrets field.
type secretCarrier interface {
	GetSecrets() map[string]string
}

// spec starts an opSpec for a call received on this endpoint. req is the
// call's request (nil where it carries nothing of interest); the keys of its
// secrets, never the values, go into the journal.
func (e *endpoint) spec(method string, req any) opSpec {
	spec := opSpec{socket: e.socket, method: method}
	if r, ok := req.(secretCarrier); ok && len(r.GetSecrets()) > 0 {
		spec.secretKeys = slices.Sorted(maps.Keys(r.GetSecrets()))
	}
	return spec
}

// identityServer serves CSI Identity.
type identityServer struct {
	csi.UnimplementedIdentityServer
	*endpoint
}

func (s *identityServer) GetPluginInfo(ctx context.Context, _ *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return runOp(ctx, s.b, s.spec(MethodGetPluginInfo, nil), func(*Call) (*csi.GetPluginInfoResponse, error) {
		return &csi.GetPluginInfoResponse{
			Name:          s.b.cfg.DriverName,
			VendorVersion: s.b.cfg.VendorVersion,
		}, nil
	})
}

func (s *identityServer) GetPluginCapabilities(ctx context.Context, _ *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return runOp(ctx, s.b, s.spec(MethodGetPluginCapabilities, nil), func(*Call) (*csi.GetPluginCapabilitiesResponse, error) {
		return &csi.GetPluginCapabilitiesResponse{Capabilities: s.b.pluginCapabilities()}, nil
	})
}

func (s *identityServer) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	// A failing Probe is a Fault; a driver that answers but is not ready is
	// SetProbeReady(false).
	return runOp(ctx, s.b, s.spec(MethodProbe, nil), func(*Call) (*csi.ProbeResponse, error) {
		return &csi.ProbeResponse{Ready: wrapperspb.Bool(!s.b.notReady)}, nil
	})
}

// pluginCapabilities lists the plugin capabilities the config asks for.
func (b *Backend) pluginCapabilities() []*csi.PluginCapability {
	service := func(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
		return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{
			Service: &csi.PluginCapability_Service{Type: t},
		}}
	}
	var caps []*csi.PluginCapability
	if !b.cfg.DisableControllerService {
		caps = append(caps, service(csi.PluginCapability_Service_CONTROLLER_SERVICE))
	}
	if b.cfg.Topology {
		caps = append(caps, service(csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS))
	}
	if b.groupControllerEnabled() {
		caps = append(caps, service(csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE))
	}
	if b.hasCapability(csi.ControllerServiceCapability_RPC_EXPAND_VOLUME) {
		// The backend can grow volumes that are in use.
		caps = append(caps, &csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{
			VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_ONLINE},
		}})
	}
	return caps
}
