package snapshotter

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/connection"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/logtest"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Each CSI call is logged once, by csi-lib-utils' interceptor on the driver connection, as
// upstream's csi-snapshotter: the request whole, secrets stripped, the response cut at
// --max-grpc-log-length. No secret reaches the log at any -v. (A test of logging itself, so
// it reads the log.)
func TestCreateSnapshotIsLoggedOnceWithTheRequestWhole(t *testing.T) {
	const maxLength = 40
	connection.SetMaxGRPCLogLength(maxLength) // process-wide, as the core sets it
	t.Cleanup(func() { connection.SetMaxGRPCLogLength(maxLength) })
	long := strings.Repeat("a-long-class-parameter-", 10)
	const secret = "s3cret" // the snapshotter secret of newWorld's class

	for _, v := range []int{5, 10} {
		t.Run(fmt.Sprintf("v=%d", v), func(t *testing.T) {
			backend, volID := newSnapshotBackend(t)
			content := dynamicContent("c1")
			content.Spec.Source.VolumeHandle = &volID
			w := newWorld(t, content)
			withLongParameter(t, w, long)
			// The driver connection as the core makes it (lifecycle.connectDriver).
			conn, err := connection.Connect(context.Background(), serveDriver(t, backend), nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { conn.Close() })
			env := &lifecycle.Env{CSI: conn, DriverName: testDriver,
				ControllerCapabilities: rpc.ControllerCapabilitySet{csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS: true}}
			w.ctrl.driver = driverFor(env, options{timeout: time.Minute})
			logger, out := logtest.Logger(v)
			ctx := klog.NewContext(context.Background(), logger)

			if err := w.ctrl.step(ctx, ctx, "c1", w.ctrl.sync); err != nil {
				t.Fatal(err)
			}
			c := w.content("c1")
			if !isReady(c) || c.Status.SnapshotHandle == nil {
				t.Fatalf("no snapshot recorded: status %+v", c.Status)
			}
			if n := len(backend.Calls(testdriver.MethodCreateSnapshot)); n != 1 {
				t.Fatalf("the driver got %d CreateSnapshot calls, want 1", n)
			}
			log := out.String()
			var calls []string
			for _, line := range strings.Split(log, "\n") {
				if strings.Contains(line, "CreateSnapshot") {
					calls = append(calls, line)
				}
			}
			if len(calls) != 1 {
				t.Errorf("the CreateSnapshot call is logged %d times, want once:\n%s", len(calls), strings.Join(calls, "\n"))
			}
			for _, call := range calls {
				if !strings.Contains(call, long) {
					t.Errorf("the request is cut in the log, want it whole (--max-grpc-log-length cuts responses only):\n%s", call)
				}
			}
			handle := *c.Status.SnapshotHandle // in the response, past its first 40 characters
			responses := 0
			for _, line := range strings.Split(log, "\n") {
				if !strings.Contains(line, "GRPC response") {
					continue
				}
				responses++
				if strings.Contains(line, handle) {
					t.Errorf("a response longer than --max-grpc-log-length is logged whole:\n%s", line)
				}
			}
			if responses == 0 {
				t.Errorf("no response is logged:\n%s", log)
			}
			if strings.Contains(log, secret) {
				t.Errorf("the secret is in the log:\n%s", log)
			}
		})
	}
}

// newSnapshotBackend is the test driver with snapshots and one volume, whose ID it returns.
func newSnapshotBackend(t *testing.T) (*testdriver.Backend, string) {
	t.Helper()
	backend, err := testdriver.New(testdriver.Config{DriverName: testDriver,
		ControllerCapabilities: append(testdriver.DefaultControllerCapabilities(),
			csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT, csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS)})
	if err != nil {
		t.Fatal(err)
	}
	rsp, err := csi.NewControllerClient(testdriver.Dial(t, backend)).CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name: "vol",
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
	})
	if err != nil {
		t.Fatalf("creating the volume: %v", err)
	}
	return backend, rsp.GetVolume().GetVolumeId()
}

// serveDriver serves backend on a UNIX socket for the life of t and returns its endpoint.
// The socket lives in a short temporary folder: socket paths are limited to about 100
// bytes, and test names make t.TempDir() too long.
func serveDriver(t *testing.T, backend *testdriver.Backend) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "csi")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	srv, err := backend.Serve(filepath.Join(dir, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return srv.Endpoint()
}

// withLongParameter gives the world's class a parameter of this value and waits for the
// controller's cache to have it.
func withLongParameter(t *testing.T, w *world, value string) {
	t.Helper()
	ctx := context.Background()
	class, err := w.snap.SnapshotV1().VolumeSnapshotClasses().Get(ctx, "class", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	class.Parameters["long"] = value
	if _, err := w.snap.SnapshotV1().VolumeSnapshotClasses().Update(ctx, class, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, time.Millisecond, wait.ForeverTestTimeout, true, func(context.Context) (bool, error) {
		cached, err := w.ctrl.classes.Get("class")
		return err == nil && cached.Parameters["long"] == value, nil
	})
	if err != nil {
		t.Fatalf("the class's new parameter never reached the cache: %v", err)
	}
}
