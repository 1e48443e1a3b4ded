// Package attacher runs `csi-sidecars attacher` processes against a real kube-apiserver +
// etcd and the project's test CSI driver, and checks what a user can observe:
// VolumeAttachments and PVs (finalizers, annotations, status), the calls the driver saw and
// whether any two overlapped on a volume, exit codes and the Lease holder.
package attacher

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

var (
	kube   controlplane.Shared
	binDir string
)

func TestMain(m *testing.M) { os.Exit(e2e.Main(m, "../../..", &kube, &binDir)) }

// fastAPI lifts the client rate limits (upstream defaults 5/10 QPS/burst), so figures show
// the attacher and the driver rather than client-side throttling.
var fastAPI = []string{"--kube-api-qps=200", "--kube-api-burst=400"}

// scenario is a harness scenario for the attacher: a node with a CSINode for the test
// driver, PVs of volumes created in the driver, and their VolumeAttachments.
type scenario struct {
	*e2e.Scenario
	leaseName string
	node      string
	nodeID    string
	// setup is a driver client of the test's own, to create volumes and to change the
	// driver's state behind the attacher's back.
	setup csi.ControllerClient
}

func newScenario(t testing.TB, cfg testdriver.Config) *scenario {
	t.Helper()
	s := e2e.NewScenario(t, kube.Get(t), binDir, cfg)
	srv, err := s.Driver.Serve(filepath.Join(s.Dir, "setup.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(srv.Endpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	sc := &scenario{
		Scenario:  s,
		leaseName: e2e.LeaseName("attacher", s.Driver.DriverName()),
		node:      s.Namespace + "-node",
		nodeID:    s.Namespace + "-node-id",
		setup:     csi.NewControllerClient(conn),
	}
	csiNode := &storagev1.CSINode{
		ObjectMeta: metav1.ObjectMeta{Name: sc.node},
		Spec:       storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: s.Driver.DriverName(), NodeID: sc.nodeID}}},
	}
	if _, err := s.Client.StorageV1().CSINodes().Create(context.Background(), csiNode, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return sc
}

// start runs an attacher replica.
func (s *scenario) start(name string, extra ...string) *e2e.Replica {
	s.T.Helper()
	return s.Start(name, []string{"csi-sidecars", "attacher"}, extra...)
}

// volumes creates n volumes in the driver and a PV for each; it returns the volume IDs,
// the i-th backing PV s.pvName(i).
func (s *scenario) volumes(n int) []string {
	s.T.Helper()
	ctx := context.Background()
	ids := make([]string, n)
	for i := range n {
		rsp, err := s.setup.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("vol-%02d", i), VolumeCapabilities: []*csi.VolumeCapability{mountCapability()}})
		if err != nil {
			s.T.Fatal(err)
		}
		ids[i] = rsp.GetVolume().GetVolumeId()
		pv := &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: s.pvName(i)},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
					Driver: s.Driver.DriverName(), VolumeHandle: ids[i], FSType: "ext4",
				}},
			},
		}
		if _, err := s.Client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
			s.T.Fatal(err)
		}
	}
	return ids
}

func (s *scenario) pvName(i int) string { return fmt.Sprintf("%s-pv-%02d", s.Namespace, i) }
func (s *scenario) vaName(i int) string { return fmt.Sprintf("%s-va-%02d", s.Namespace, i) }

// attach creates the VolumeAttachments of PVs 0..n-1 to the node, as the attach/detach
// controller would.
func (s *scenario) attach(n int) {
	s.T.Helper()
	for i := range n {
		s.attachOne(i)
	}
}

// attachOne creates the VolumeAttachment of PV i to the node.
func (s *scenario) attachOne(i int) {
	s.T.Helper()
	pvName := s.pvName(i)
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: s.vaName(i)},
		Spec: storagev1.VolumeAttachmentSpec{
			Attacher: s.Driver.DriverName(),
			NodeName: s.node,
			Source:   storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName},
		},
	}
	if _, err := s.Client.StorageV1().VolumeAttachments().Create(context.Background(), va, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
}

// attachments returns the scenario's VolumeAttachments by name.
func (s *scenario) attachments() map[string]storagev1.VolumeAttachment {
	s.T.Helper()
	list, err := s.Client.StorageV1().VolumeAttachments().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	out := map[string]storagev1.VolumeAttachment{}
	for _, va := range list.Items {
		if va.Spec.Attacher == s.Driver.DriverName() {
			out[va.Name] = va
		}
	}
	return out
}

// waitAllAttached waits until VolumeAttachments 0..n-1 report attached.
func (s *scenario) waitAllAttached(n int) {
	s.T.Helper()
	s.WaitUntil(fmt.Sprintf("%d VolumeAttachments attached", n), func() bool {
		vas := s.attachments()
		for i := range n {
			if !vas[s.vaName(i)].Status.Attached {
				return false
			}
		}
		return true
	})
}

func (s *scenario) finalizer() string {
	return "external-attacher/" + lifecycle.SanitizeName(s.Driver.DriverName())
}

// apiWrites is the API server's count of PATCH and UPDATE requests on VolumeAttachments
// and PersistentVolumes (any subresource), from apiserver_request_total on its /metrics.
// Only the attachers write these objects in these tests (the tests create and delete), so
// differences of it are the attachers' writes, failed ones included.
func (s *scenario) apiWrites() float64 {
	s.T.Helper()
	raw, err := s.Client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(context.Background())
	if err != nil {
		s.T.Fatalf("reading the API server's metrics: %v", err)
	}
	var total float64
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "apiserver_request_total{") {
			continue
		}
		if !strings.Contains(line, `resource="volumeattachments"`) && !strings.Contains(line, `resource="persistentvolumes"`) {
			continue
		}
		if !strings.Contains(line, `verb="PATCH"`) && !strings.Contains(line, `verb="UPDATE"`) {
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil {
			s.T.Fatalf("metric line %q: %v", line, err)
		}
		total += v
	}
	return total
}

func mountCapability() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}
