package testdriver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// endpoint is what every service of one socket shares: the backend and the
// socket path the journal names.
type endpoint struct {
	b      *Backend
	socket string
}

// spec starts an opSpec for a call received on this endpoint.
func (e *endpoint) spec(method string) opSpec {
	return opSpec{socket: e.socket, method: method}
}

// identityServer serves CSI Identity.
type identityServer struct {
	csi.UnimplementedIdentityServer
	*endpoint
}

func (s *identityServer) GetPluginInfo(ctx context.Context, _ *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return runOp(ctx, s.b, s.spec(MethodGetPluginInfo), func(*Call) (*csi.GetPluginInfoResponse, error) {
		return &csi.GetPluginInfoResponse{
			Name:          s.b.cfg.DriverName,
			VendorVersion: s.b.cfg.VendorVersion,
		}, nil
	})
}

func (s *identityServer) GetPluginCapabilities(ctx context.Context, _ *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return runOp(ctx, s.b, s.spec(MethodGetPluginCapabilities), func(*Call) (*csi.GetPluginCapabilitiesResponse, error) {
		return &csi.GetPluginCapabilitiesResponse{Capabilities: s.b.pluginCapabilities()}, nil
	})
}

func (s *identityServer) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	// Readiness problems are simulated with a Fault on Probe.
	return runOp(ctx, s.b, s.spec(MethodProbe), func(*Call) (*csi.ProbeResponse, error) {
		return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
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
	if b.hasCapability(csi.ControllerServiceCapability_RPC_EXPAND_VOLUME) {
		// The backend can grow volumes that are in use.
		caps = append(caps, &csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{
			VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_ONLINE},
		}})
	}
	return caps
}
