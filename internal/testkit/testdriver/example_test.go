package testdriver_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// Example shows what an end-to-end test does: serve one backend on two
// sockets (one per sidecar replica), slow it down, let the sidecars work,
// wait for their calls and judge them from the journal and the overlaps.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dir, err := os.MkdirTemp("", "testdriver")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	b, err := testdriver.New(testdriver.Config{Latency: 5 * time.Millisecond})
	if err != nil {
		log.Fatal(err)
	}
	var servers []*testdriver.Server
	for _, name := range []string{"replica-0.sock", "replica-1.sock"} {
		srv, err := b.Serve(filepath.Join(dir, name))
		if err != nil {
			log.Fatal(err)
		}
		defer srv.Stop()
		servers = append(servers, srv) // srv.Endpoint() goes to a sidecar's --csi-address
	}
	b.SetMethodLatency(testdriver.MethodControllerPublishVolume, 20*time.Millisecond)

	// Here a test would start the sidecars; this example plays one itself.
	conn, err := grpc.NewClient(servers[1].Endpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	go func() {
		c := csi.NewControllerClient(conn)
		vol, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: "pvc-1",
			VolumeCapabilities: []*csi.VolumeCapability{{
				AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
			}},
		})
		if err != nil {
			log.Print(err)
			return
		}
		_, _ = c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: vol.GetVolume().GetVolumeId(),
			NodeId:   "node-1",
			VolumeCapability: &csi.VolumeCapability{
				AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
			},
		})
	}()

	// Wait, without sleeping, until two calls have ended in the backend.
	err = b.WaitFor(ctx, func(calls []testdriver.Call) bool {
		done := 0
		for _, c := range calls {
			if c.Done() {
				done++
			}
		}
		return done == 2
	})
	if err != nil {
		log.Fatal(err)
	}
	for _, c := range b.Journal() {
		fmt.Println(filepath.Base(c.Socket), c.Method, c.VolumeID, c.NodeID, c.Code, c.Canceled)
	}
	fmt.Println("overlaps:", len(b.Overlaps()))
	// Output:
	// replica-1.sock CreateVolume vol-00000001  OK false
	// replica-1.sock ControllerPublishVolume vol-00000001 node-1 OK false
	// overlaps: 0
}
