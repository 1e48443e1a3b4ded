package testdriver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"google.golang.org/grpc"
	"k8s.io/klog/v2"
)

// Server is one gRPC server of the driver, listening on one UNIX socket.
type Server struct {
	socket string
	grpc   *grpc.Server
	served chan struct{}
	once   sync.Once
}

// Serve starts serving the Identity, Controller, GroupController and Node
// services of b on a UNIX socket at socketPath, replacing a stale socket file
// left by an earlier run. Stop makes the socket unreachable again.
func (b *Backend) Serve(socketPath string) (*Server, error) {
	if err := os.Remove(socketPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("removing stale socket %s: %w", socketPath, err)
	}
	lis, err := net.Listen("unix", socketPath)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", socketPath, err)
	}
	// The socket file is removed by Stop, not by the listener: Stop may run
	// after gRPC has closed the listener.
	lis.(*net.UnixListener).SetUnlinkOnClose(false)

	s := &Server{
		socket: socketPath,
		grpc:   b.grpcServer(socketPath),
		served: make(chan struct{}),
	}

	go func() {
		defer close(s.served)
		if err := s.grpc.Serve(lis); err != nil {
			klog.ErrorS(err, "Serving CSI", "socket", socketPath)
		}
	}()
	klog.V(2).InfoS("Serving CSI", "socket", socketPath, "driver", b.cfg.DriverName)
	return s, nil
}

// grpcServer is a gRPC server of the Identity, Controller, GroupController and Node
// services of b; socket names it in the journal and the logs.
func (b *Backend) grpcServer(socket string) *grpc.Server {
	srv := grpc.NewServer(grpc.UnaryInterceptor(logCalls(socket)))
	ep := &endpoint{b: b, socket: socket}
	csi.RegisterIdentityServer(srv, &identityServer{endpoint: ep})
	csi.RegisterControllerServer(srv, &controllerServer{endpoint: ep})
	csi.RegisterGroupControllerServer(srv, &groupControllerServer{endpoint: ep})
	csi.RegisterNodeServer(srv, &nodeServer{endpoint: ep})
	return srv
}

// Socket is the path of the server's UNIX socket.
func (s *Server) Socket() string { return s.socket }

// Endpoint is the socket as a gRPC target, e.g. for a sidecar's --csi-address.
func (s *Server) Endpoint() string { return "unix://" + s.socket }

// Stop closes the listener and every connection at once, like a driver
// process that dies, and removes the socket file. RPCs in flight fail for
// their callers, but their backend operations still run to their end. Stop
// may be called more than once.
func (s *Server) Stop() {
	s.once.Do(func() {
		s.grpc.Stop()
		<-s.served
		if err := os.Remove(s.socket); err != nil && !errors.Is(err, os.ErrNotExist) {
			klog.ErrorS(err, "Removing socket", "socket", s.socket)
		}
	})
}

// logCalls logs each RPC at verbosity 4 with secrets stripped from the
// request, since CSI requests may carry credentials.
func logCalls(socket string) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		logger := klog.V(4)
		if logger.Enabled() {
			logger.InfoS("CSI call", "socket", socket, "method", info.FullMethod, "request", protosanitizer.StripSecrets(req))
		}
		rsp, err := handler(ctx, req)
		if logger.Enabled() {
			logger.InfoS("CSI call returned", "socket", socket, "method", info.FullMethod, "response", protosanitizer.StripSecrets(rsp), "err", err)
		}
		return rsp, err
	}
}
