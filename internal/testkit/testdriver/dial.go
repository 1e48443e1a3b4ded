package testdriver

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
)

// Dial serves b on a new UNIX socket for the life of t and returns a client connection
// to it, for unit tests of sidecars that call the driver. The socket lives in a short
// temporary folder: socket paths are limited to about 100 bytes, and test names make
// t.TempDir() too long.
func Dial(t testing.TB, b *Backend) *grpc.ClientConn {
	t.Helper()
	dir, err := os.MkdirTemp("", "csi")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	srv, err := b.Serve(filepath.Join(dir, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(srv.Endpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// DialInMemory serves b over an in-memory connection for the life of t and returns a
// client connection to it: no socket, no real I/O, so that a unit test may run the driver
// and the sidecar inside a testing/synctest bubble, on its fake clock. The journal names
// the endpoint "in-memory".
func DialInMemory(t testing.TB, b *Backend) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	srv := b.grpcServer("in-memory")
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-served
	})
	conn, err := grpc.NewClient("passthrough:///in-memory",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}
