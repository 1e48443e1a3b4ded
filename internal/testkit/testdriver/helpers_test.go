package testdriver_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// fastLatency keeps tests quick where latency is not the subject while still
// making every operation asynchronous.
const fastLatency = 2 * time.Millisecond

// driver is a backend served on some sockets, with a client per socket.
type driver struct {
	b       *testdriver.Backend
	servers []*testdriver.Server
	conns   []*grpc.ClientConn
}

// startDriver serves a new backend on n sockets in a temporary directory and
// connects to each. Everything is torn down when the test ends.
func startDriver(t *testing.T, cfg testdriver.Config, n int) *driver {
	t.Helper()
	b, err := testdriver.New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	d := &driver{b: b}
	dir := t.TempDir()
	for i := range n {
		srv, err := b.Serve(filepath.Join(dir, fmt.Sprintf("csi-%d.sock", i)))
		if err != nil {
			t.Fatalf("Serve: %v", err)
		}
		t.Cleanup(srv.Stop)
		conn, err := grpc.NewClient(srv.Endpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatalf("connecting to %s: %v", srv.Socket(), err)
		}
		t.Cleanup(func() { conn.Close() })
		d.servers = append(d.servers, srv)
		d.conns = append(d.conns, conn)
	}
	return d
}

func (d *driver) ctrl(i int) csi.ControllerClient { return csi.NewControllerClient(d.conns[i]) }
func (d *driver) ident(i int) csi.IdentityClient  { return csi.NewIdentityClient(d.conns[i]) }

// testCtx is a context that ends with the test, bounding every wait.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func mountCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func createReq(name string, size int64) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)},
	}
}

func publishReq(volumeID, node string, readonly bool) *csi.ControllerPublishVolumeRequest {
	return &csi.ControllerPublishVolumeRequest{
		VolumeId:         volumeID,
		NodeId:           node,
		Readonly:         readonly,
		VolumeCapability: mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER),
	}
}

// mustCreate creates a volume and returns its id.
func mustCreate(ctx context.Context, t *testing.T, c csi.ControllerClient, name string) string {
	t.Helper()
	rsp, err := c.CreateVolume(ctx, createReq(name, 1<<20))
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return rsp.GetVolume().GetVolumeId()
}

// wantCode fails the test unless err carries the gRPC code want.
func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Errorf("%s: got code %s (%v), want %s", what, got, err, want)
	}
}

// callsOf returns the journaled calls of one method.
func callsOf(calls []testdriver.Call, method string) []testdriver.Call {
	return testdriver.CallsOf(calls, method)
}

// doneCalls is a WaitFor condition: at least n finished calls of method.
func doneCalls(method string, n int) func([]testdriver.Call) bool {
	return func(calls []testdriver.Call) bool {
		done := 0
		for _, c := range callsOf(calls, method) {
			if c.Done() {
				done++
			}
		}
		return done >= n
	}
}

// startedCalls is a WaitFor condition: at least n started calls of method.
func startedCalls(method string, n int) func([]testdriver.Call) bool {
	return func(calls []testdriver.Call) bool { return len(callsOf(calls, method)) >= n }
}

// waitForReady makes a call wait for a reconnect instead of failing fast.
func waitForReady() grpc.CallOption { return grpc.WaitForReady(true) }
