// Package healthmonitor runs `csi-sidecars health-monitor` processes against a real
// kube-apiserver + etcd and the project's test CSI driver, and checks what a user observes:
// the claims' status.healthStatus (the API server's CSIVolumeHealth gate on) or their events
// (a second API server with the gate off), resourceVersions for writes, exit codes and the
// Lease. The tests bind PV/PVC pairs themselves; no controller manager runs, and the node
// watcher's Nodes and Pods are objects the test writes, as a kubelet and a scheduler would.
//
// BenchmarkHealthMonitor (make bench) measures the monitor on 1,000 bound volumes: its API
// writes per interval while all are healthy (from the API server's audit log, kept only
// when benchmarks run) and the time from a driver's report to the claim showing it.
package healthmonitor

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

var (
	kube   controlplane.Shared
	binDir string
)

// auditLog is the API server's audit log (auditPolicy), kept only when benchmarks run.
var auditLog string

// auditPolicy logs every write (events' with their body) and the marker audit.UpTo sends.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
` + audit.MarkerRule + audit.WriteRules + `- level: None
`

// The shared API server keeps status.healthStatus: its alpha CSIVolumeHealth gate is on.
// When benchmarks run it also writes an audit log of every write.
func TestMain(m *testing.M) { os.Exit(run(m)) }

func run(m *testing.M) int {
	flag.Parse()
	args := []string{"--feature-gates=CSIVolumeHealth=true"}
	if e2e.Benchmarks() && !testing.Short() && os.Getenv(controlplane.SkipEnv) != "1" {
		dir, err := os.MkdirTemp("", "csi-sidecars-healthmonitor-audit-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		auditArgs, log, err := audit.Setup(dir, auditPolicy)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		auditLog = log
		args = append(args, auditArgs...)
	}
	return e2e.MainWith(m, "../../..", &kube, &binDir, controlplane.Options{APIServerArgs: args})
}

// interval is the list pass interval of the tests' replicas.
const interval = "--list-volumes-interval=1s"

type scenario struct {
	*e2e.Scenario
	leaseName string
	csi       csi.ControllerClient
}

// healthDriver is a driver with both health capabilities that pages its health list by
// two.
func healthDriver() testdriver.Config {
	return testdriver.Config{HealthPageSize: 2, ControllerCapabilities: append(testdriver.DefaultControllerCapabilities(),
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH)}
}

func newScenario(t testing.TB, cp *controlplane.ControlPlane, cfg testdriver.Config) *scenario {
	t.Helper()
	s := &scenario{Scenario: e2e.NewScenario(t, cp, binDir, cfg)}
	s.leaseName = e2e.LeaseName("health-monitor", s.Driver.DriverName())
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
	return s
}

func (s *scenario) startReplica(name string, extra ...string) *e2e.Replica {
	s.T.Helper()
	return s.Start(name, []string{"csi-sidecars", "health-monitor"}, append([]string{interval}, extra...)...)
}

// pair is a bound PV/PVC pair and its backend volume.
type pair struct{ claim, pv, volumeID string }

// createPair creates a backend volume, a claim and a PV bound to each other, as the
// provisioner and the PV controller would.
func (s *scenario) createPair(name string) pair {
	s.T.Helper()
	p, err := s.makePair(context.Background(), s.Client, name)
	if err != nil {
		s.T.Fatal(err)
	}
	s.T.Cleanup(func() {
		_ = s.Client.CoreV1().PersistentVolumes().Delete(context.Background(), p.pv, metav1.DeleteOptions{})
	})
	return p
}

// pairLabel marks the PVs of a scenario, for a benchmark's clean-up of many at once.
const pairLabel = "healthmonitor.csi-sidecars.io/scenario"

// makePair is createPair through client, safe to call from several goroutines; the PV it
// leaves is the caller's to delete (it carries pairLabel).
func (s *scenario) makePair(ctx context.Context, client kubernetes.Interface, name string) (pair, error) {
	rsp, err := s.csi.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: s.Namespace + "-" + name,
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}})
	if err != nil {
		return pair{}, fmt.Errorf("CreateVolume %s: %w", name, err)
	}
	p := pair{claim: name, pv: s.Namespace + "-" + name, volumeID: rsp.GetVolume().GetVolumeId()}
	size := v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}
	empty := ""
	pvc, err := client.CoreV1().PersistentVolumeClaims(s.Namespace).Create(ctx, &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PersistentVolumeClaimSpec{AccessModes: []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce}, StorageClassName: &empty,
			VolumeName: p.pv, Resources: v1.VolumeResourceRequirements{Requests: size}},
	}, metav1.CreateOptions{})
	if err != nil {
		return p, fmt.Errorf("creating claim %s: %w", name, err)
	}
	pv, err := client.CoreV1().PersistentVolumes().Create(ctx, &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: p.pv, Labels: map[string]string{pairLabel: s.Namespace}},
		Spec: v1.PersistentVolumeSpec{AccessModes: pvc.Spec.AccessModes, Capacity: size,
			ClaimRef:               &v1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: s.Namespace, Name: name, UID: pvc.UID},
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: s.Driver.DriverName(), VolumeHandle: p.volumeID}}},
	}, metav1.CreateOptions{})
	if err != nil {
		return p, fmt.Errorf("creating PV %s: %w", p.pv, err)
	}
	pv.Status.Phase = v1.VolumeBound
	if _, err := client.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
		return p, fmt.Errorf("binding PV %s: %w", p.pv, err)
	}
	pvc.Status = v1.PersistentVolumeClaimStatus{Phase: v1.ClaimBound, AccessModes: pvc.Spec.AccessModes, Capacity: size}
	if _, err := client.CoreV1().PersistentVolumeClaims(s.Namespace).UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		return p, fmt.Errorf("binding claim %s: %w", name, err)
	}
	return p, nil
}

func (s *scenario) claim(name string) *v1.PersistentVolumeClaim {
	s.T.Helper()
	pvc, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return pvc
}

func (s *scenario) setHealth(p pair, conds ...testdriver.HealthCondition) {
	s.T.Helper()
	if err := s.Driver.SetVolumeHealth(p.volumeID, conds...); err != nil {
		s.T.Fatal(err)
	}
}

// conditions is a claim's health as "Status/Reason" strings; nil when healthy.
func (s *scenario) conditions(name string) []string {
	h := s.claim(name).Status.HealthStatus
	if h == nil {
		return nil
	}
	var out []string
	for _, c := range h.HealthConditions {
		out = append(out, fmt.Sprintf("%s/%s", c.Status, c.Reason))
	}
	return out
}

// versions are the resourceVersions of claims, by name.
func (s *scenario) versions(names ...string) map[string]string {
	out := map[string]string{}
	for _, n := range names {
		out[n] = s.claim(n).ResourceVersion
	}
	return out
}

// passes waits for n more complete list passes: n more list calls without a next page.
func (s *scenario) passes(n int) {
	s.T.Helper()
	last := func(calls []testdriver.Call) int {
		done := 0
		for _, c := range testdriver.CallsOf(calls, testdriver.MethodControllerListVolumeHealth) {
			if c.Done() {
				done++
			}
		}
		return done
	}
	start := last(s.Driver.Journal())
	s.WaitForCalls(fmt.Sprintf("%d more list calls", n), func(c []testdriver.Call) bool { return last(c) >= start+n })
}

var (
	degraded = testdriver.HealthCondition{Status: csi.VolumeHealthErrorType_DEGRADED, Reason: "ReplicaLost", Message: "one replica of three lost"}
	lost     = testdriver.HealthCondition{Status: csi.VolumeHealthErrorType_DATA_LOSS, Reason: "Corrupt", Message: "checksum errors"}
	down     = testdriver.HealthCondition{Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: "PathDown"}
)
