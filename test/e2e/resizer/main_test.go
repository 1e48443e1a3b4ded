// Package resizer runs `csi-sidecars resizer` processes against a real kube-apiserver + etcd
// and the project's test CSI driver, and checks what a user observes: PVC and PV fields,
// the driver's journal, exit codes and the Lease. No kube-controller-manager or kubelet
// runs: the tests bind PV/PVC pairs themselves, play the kubelet's part of a node
// expansion, and create Pods as the scheduler and kubelet would leave them.
package resizer

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

var (
	kube   controlplane.Shared
	binDir string
)

func TestMain(m *testing.M) { os.Exit(e2e.Main(m, "../../..", &kube, &binDir)) }

// scenario is a harness scenario for the resizer: a StorageClass that allows expansion (the
// API server's PersistentVolumeClaimResize admission requires one) and a CSI client to
// create backend volumes with.
type scenario struct {
	*e2e.Scenario
	leaseName string
	class     string
	csi       csi.ControllerClient
}

func newScenario(t *testing.T, cfg testdriver.Config) *scenario {
	t.Helper()
	s := &scenario{Scenario: e2e.NewScenario(t, kube.Get(t), binDir, cfg)}
	s.leaseName = e2e.LeaseName("resizer", s.Driver.DriverName())
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
	s.csi = csi.NewControllerClient(conn)
	s.class = s.Namespace
	sc := &storagev1.StorageClass{
		ObjectMeta:           metav1.ObjectMeta{Name: s.class},
		Provisioner:          s.Driver.DriverName(),
		AllowVolumeExpansion: ptr.To(true),
	}
	if _, err := s.Client.StorageV1().StorageClasses().Create(context.Background(), sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = s.Client.StorageV1().StorageClasses().Delete(context.Background(), s.class, metav1.DeleteOptions{})
	})
	return s
}

func (s *scenario) startReplica(name string, extra ...string) *e2e.Replica {
	s.T.Helper()
	return s.Start(name, []string{"csi-sidecars", "resizer"}, extra...)
}

// pair is a bound PV/PVC pair and its backend volume.
type pair struct {
	name, pv, volumeID string
}

// createPair creates a backend volume of 1Gi, a PV for it and a PVC bound to it, as the
// provisioner and the PV controller would; vac, if set, is the class both start with.
func (s *scenario) createPair(name, vac string) pair {
	s.T.Helper()
	p, _ := s.newPair(name, vac, true)
	return p
}

// createPV creates a PV createClaimFirst returned, and deletes it at the end of the test.
func (s *scenario) createPV(pv *v1.PersistentVolume) {
	s.T.Helper()
	if _, err := s.Client.CoreV1().PersistentVolumes().Create(context.Background(), pv, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	s.T.Cleanup(func() {
		_ = s.Client.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{})
	})
}

// createClaimFirst is createPair without creating the PV, which it returns: the PVC is
// bound to a PV the API server does not have yet.
func (s *scenario) createClaimFirst(name, vac string) (pair, *v1.PersistentVolume) {
	s.T.Helper()
	return s.newPair(name, vac, false)
}

// newPair creates the backend volume and the PVC, and the PV when withPV is set, before
// the PVC's status says it is bound (as the PV controller binds).
func (s *scenario) newPair(name, vac string, withPV bool) (pair, *v1.PersistentVolume) {
	s.T.Helper()
	ctx := context.Background()
	rsp, err := s.csi.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name:               s.Namespace + "-" + name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 1 << 30},
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
	})
	if err != nil {
		s.T.Fatal(err)
	}
	p := pair{name: name, pv: s.Namespace + "-" + name, volumeID: rsp.GetVolume().GetVolumeId()}
	var class *string
	if vac != "" {
		class = ptr.To(vac)
	}
	pvc := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PersistentVolumeClaimSpec{
			AccessModes:               []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			StorageClassName:          &s.class,
			VolumeName:                p.pv,
			VolumeAttributesClassName: class,
			Resources:                 v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	pvc, err = s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Create(ctx, pvc, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	pv := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: p.pv},
		Spec: v1.PersistentVolumeSpec{
			AccessModes:               []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			Capacity:                  v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")},
			StorageClassName:          s.class,
			VolumeAttributesClassName: class,
			ClaimRef:                  &v1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: s.Namespace, Name: name, UID: pvc.UID},
			PersistentVolumeSource:    v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: s.Driver.DriverName(), VolumeHandle: p.volumeID}},
		},
	}
	if withPV {
		s.createPV(pv)
	}
	pvc.Status = v1.PersistentVolumeClaimStatus{
		Phase:                            v1.ClaimBound,
		AccessModes:                      pvc.Spec.AccessModes,
		Capacity:                         v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")},
		CurrentVolumeAttributesClassName: class,
	}
	if _, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	return p, pv
}

func (s *scenario) pvc(name string) *v1.PersistentVolumeClaim {
	s.T.Helper()
	pvc, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return pvc
}

func (s *scenario) pvObject(name string) *v1.PersistentVolume {
	s.T.Helper()
	pv, err := s.Client.CoreV1().PersistentVolumes().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return pv
}

// request sets a PVC's storage request, as a user does.
func (s *scenario) request(name, size string) {
	s.T.Helper()
	pvc := s.pvc(name)
	pvc.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse(size)
	if _, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Update(context.Background(), pvc, metav1.UpdateOptions{}); err != nil {
		s.T.Fatalf("requesting %s for %s: %v", size, name, err)
	}
}

func capacityOf(pvc *v1.PersistentVolumeClaim) string {
	q := pvc.Status.Capacity[v1.ResourceStorage]
	return q.String()
}

func pvCapacity(pv *v1.PersistentVolume) string {
	q := pv.Spec.Capacity[v1.ResourceStorage]
	return q.String()
}

func resizeState(pvc *v1.PersistentVolumeClaim) v1.ClaimResourceStatus {
	return pvc.Status.AllocatedResourceStatuses[v1.ResourceStorage]
}

func hasCondition(pvc *v1.PersistentVolumeClaim, t v1.PersistentVolumeClaimConditionType) bool {
	for _, c := range pvc.Status.Conditions {
		if c.Type == t && c.Status == v1.ConditionTrue {
			return true
		}
	}
	return false
}

// expandCalls are the ControllerExpandVolume calls in calls, by volume id.
func expandCalls(calls []testdriver.Call) map[string][]testdriver.Call {
	out := map[string][]testdriver.Call{}
	for _, c := range calls {
		if c.Method == testdriver.MethodControllerExpandVolume {
			out[c.VolumeID] = append(out[c.VolumeID], c)
		}
	}
	return out
}

// writeCounter reads the API server's request counters, to count the writes a test caused.
type writeCounter struct{ s *scenario }

// writes sums apiserver_request_total for the verbs the resizer writes with (PATCH, and
// POST for events) on PVCs, PVs and events; the tests themselves only PUT.
func (w writeCounter) writes() map[string]float64 {
	w.s.T.Helper()
	raw, err := w.s.Client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(context.Background())
	if err != nil {
		w.s.T.Fatalf("reading API server metrics: %v", err)
	}
	out := map[string]float64{}
	for _, line := range strings.Split(string(raw), "\n") {
		if !strings.HasPrefix(line, "apiserver_request_total{") {
			continue
		}
		labels, value, ok := strings.Cut(line, "} ")
		if !ok {
			continue
		}
		verb, resource, sub := label(labels, "verb"), label(labels, "resource"), label(labels, "subresource")
		switch verb {
		case "PATCH", "POST":
		default:
			continue
		}
		switch resource {
		case "persistentvolumeclaims", "persistentvolumes", "events":
		default:
			continue
		}
		var v float64
		fmt.Sscan(value, &v)
		key := resource
		if sub != "" {
			key += "/" + sub
		}
		out[key+" "+verb] += v
	}
	return out
}

func label(labels, name string) string {
	_, rest, ok := strings.Cut(labels, name+`="`)
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
}

// since returns the counters' growth from before.
func since(before, after map[string]float64) map[string]float64 {
	out := map[string]float64{}
	for k, v := range after {
		if d := v - before[k]; d > 0 {
			out[k] = d
		}
	}
	return out
}
