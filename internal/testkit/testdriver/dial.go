package testdriver

import (
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
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
