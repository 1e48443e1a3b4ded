package registrar

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// healthCheckKey marks the GetInfo calls of the registrar's own health check, which are no
// registrations.
const healthCheckKey = "csi-sidecars-health-check"

// registration is the kubelet's plugin registration service for one driver. It counts the
// registrations the kubelet runs: a connection that asked GetInfo, is still open and has
// not reported the status yet. A drain lets them end, as the kubelet reports the status on
// the connection it asked GetInfo on and unregisters the driver when that report fails.
// It is the gRPC server's stats handler too, to see connections end.
type registration struct {
	registerapi.UnimplementedRegistrationServer
	driver   string
	endpoint string

	mu      sync.Mutex
	pending map[*connTag]bool
	changed chan struct{} // closed and replaced whenever pending changes
	// failed receives the kubelet's report that the registration failed.
	failed chan error
}

// connTag tells one connection of the registration server from another.
type connTag struct{}

type connTagKey struct{}

var _ stats.Handler = &registration{}

func newRegistration(driver, endpoint string) *registration {
	return &registration{driver: driver, endpoint: endpoint, pending: map[*connTag]bool{}, changed: make(chan struct{}), failed: make(chan error, 1)}
}

// TagConn implements stats.Handler: each connection's calls carry its tag.
func (r *registration) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return context.WithValue(ctx, connTagKey{}, &connTag{})
}

// HandleConn implements stats.Handler: a registration whose connection closed is over.
func (r *registration) HandleConn(ctx context.Context, s stats.ConnStats) {
	if _, ok := s.(*stats.ConnEnd); ok {
		r.setPending(ctx, false)
	}
}

// TagRPC implements stats.Handler.
func (r *registration) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

// HandleRPC implements stats.Handler.
func (r *registration) HandleRPC(context.Context, stats.RPCStats) {}

func (r *registration) setPending(ctx context.Context, pending bool) {
	tag, ok := ctx.Value(connTagKey{}).(*connTag)
	if !ok {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if pending == r.pending[tag] {
		return
	}
	if pending {
		r.pending[tag] = true
	} else {
		delete(r.pending, tag)
	}
	close(r.changed)
	r.changed = make(chan struct{})
}

// GetInfo answers what upstream answers: a CSI plugin, the driver's name, the driver's
// socket as the kubelet sees it, version 1.0.0.
func (r *registration) GetInfo(ctx context.Context, _ *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	if md, _ := metadata.FromIncomingContext(ctx); len(md.Get(healthCheckKey)) == 0 {
		r.setPending(ctx, true)
	}
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.driver,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

// NotifyRegistrationStatus ends a registration. A failed one ends the sidecar with an
// error, as upstream's exits 1 for the kubelet to restart it.
func (r *registration) NotifyRegistrationStatus(ctx context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	r.setPending(ctx, false)
	if !st.GetPluginRegistered() {
		err := fmt.Errorf("the kubelet reports that registering the driver failed: %s", st.GetError())
		select {
		case r.failed <- err:
		default:
		}
		return &registerapi.RegistrationStatusResponse{}, nil
	}
	klog.FromContext(ctx).Info("Registered with the kubelet", "driver", r.driver)
	return &registerapi.RegistrationStatusResponse{}, nil
}

// waitPending returns once no registration the kubelet started is waiting for its report,
// or ctx ended.
func (r *registration) waitPending(ctx context.Context) error {
	for {
		r.mu.Lock()
		n, changed := len(r.pending), r.changed
		r.mu.Unlock()
		if n == 0 {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return errors.Join(fmt.Errorf("%d registration(s) of the kubelet still running", n), ctx.Err())
		}
	}
}
