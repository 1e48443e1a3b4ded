package attacher

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/connection"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/logtest"
)

// Each CSI call is logged once, by csi-lib-utils' interceptor on the driver connection, as
// upstream's external-attacher: the request whole, secrets stripped, the response cut at
// --max-grpc-log-length. No secret reaches the log at any -v. (A test of logging itself, so
// it reads the log.)
func TestPublishIsLoggedOnceWithTheRequestWhole(t *testing.T) {
	const maxLength = 40
	connection.SetMaxGRPCLogLength(maxLength) // process-wide, as the core sets it
	t.Cleanup(func() { connection.SetMaxGRPCLogLength(maxLength) })
	long := strings.Repeat("a-long-volume-attribute-", 10)
	const secret = "s3cret-password-value"

	for _, v := range []int{5, 10} {
		t.Run(fmt.Sprintf("v=%d", v), func(t *testing.T) {
			backend, volID := newBackendWithVolume(t)
			withLongAttribute := func(pv *corev1.PersistentVolume) { pv.Spec.CSI.VolumeAttributes = map[string]string{"long": long} }
			f := newFixture(t, defaultConfig(), backend,
				newPV("pv", volID, withLongAttribute, withSecretRef), newVA("va", "pv"), newCSINode(testNode, testNodeID),
				&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "creds"}, Data: map[string][]byte{"password": []byte(secret)}})
			// The driver connection as the core makes it (lifecycle.connectDriver).
			srv, err := backend.Serve(t.TempDir() + "/csi.sock")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(srv.Stop)
			conn, err := connection.Connect(context.Background(), srv.Endpoint(), nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { conn.Close() })
			f.ctrl.calls.Client = csi.NewControllerClient(conn)
			logger, out := logtest.Logger(v)
			f.ctrl.ops = klog.NewContext(f.ctrl.ops, logger)

			if err := f.sync("va"); err != nil {
				t.Fatal(err)
			}
			if !f.va("va").Status.Attached {
				t.Fatal("not attached")
			}
			log := out.String()
			var calls []string
			for _, line := range strings.Split(log, "\n") {
				if strings.Contains(line, "ControllerPublishVolume") && strings.Contains(line, "GRPC call") {
					calls = append(calls, line)
				}
			}
			if len(calls) != 1 {
				t.Errorf("the publish is logged %d times, want once:\n%s", len(calls), strings.Join(calls, "\n"))
			}
			for _, call := range calls {
				if !strings.Contains(call, long) {
					t.Errorf("the request is cut in the log, want it whole (--max-grpc-log-length cuts responses only):\n%s", call)
				}
			}
			devicePath := "/dev/testdriver/" + volID // the response's publish context
			for _, line := range strings.Split(log, "\n") {
				if strings.Contains(line, "GRPC response") && strings.Contains(line, devicePath) {
					t.Errorf("a response longer than --max-grpc-log-length is logged whole:\n%s", line)
				}
			}
			if strings.Contains(log, secret) {
				t.Errorf("the secret is in the log:\n%s", log)
			}
		})
	}
}
