// Package snapshotter runs `csi-sidecars snapshotter` processes against a real
// kube-apiserver + etcd, the real snapshot-controller of external-snapshotter v8.7 and the
// project's test CSI driver, and checks what a user can observe: VolumeSnapshots and their
// contents (status, finalizers, annotations), the snapshots in the driver's backend, the
// calls the driver saw and whether any two overlapped, exit codes and the Lease holder.
//
// BenchmarkSnapshotWrites counts, from the API server's audit log (kept only when benchmarks
// run), the API writes per operation of ours and of upstream's csi-snapshotter v8.7.0 side by
// side on the same workload.
package snapshotter

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/snapshotcontroller"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

var (
	kube   controlplane.Shared
	binDir string
)

// TestMain runs the package with one control plane; when benchmarks run, its API server
// keeps an audit log and upstream's csi-snapshotter is built first (benchSetup).
func TestMain(m *testing.M) { os.Exit(run(m)) }

func run(m *testing.M) int {
	flag.Parse()
	opts, cleanup, err := benchSetup()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer cleanup()
	return e2e.MainWith(m, "../../..", &kube, &binDir, opts)
}

// snapshotCaps is a driver that takes and lists snapshots.
func snapshotCaps() []csi.ControllerServiceCapability_RPC_Type {
	return append(testdriver.DefaultControllerCapabilities(),
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT, csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS)
}

// scenario is a harness scenario for the snapshotter: the real snapshot-controller, a
// VolumeSnapshotClass of the driver, and claims bound to volumes of the driver.
type scenario struct {
	*e2e.Scenario
	leaseName string
	class     string
	snaps     snapclientset.Interface
	ctrl      *snapshotcontroller.Controller
	setup     csi.ControllerClient
}

func newScenario(t testing.TB, cfg testdriver.Config) *scenario {
	t.Helper()
	return newScenarioWith(t, cfg, "--kube-api-qps=100", "--kube-api-burst=200")
}

// newScenarioWith is newScenario with the snapshot-controller's API flags (its default
// is upstream's 5 QPS, burst 10).
func newScenarioWith(t testing.TB, cfg testdriver.Config, controllerArgs ...string) *scenario {
	t.Helper()
	e2e.RequireBinaries(t, binDir)
	if cfg.ControllerCapabilities == nil {
		cfg.ControllerCapabilities = snapshotCaps()
	}
	s := e2e.NewScenario(t, kube.Get(t), binDir, cfg)
	ctrl, err := snapshotcontroller.Start(context.Background(), s.CP, snapshotcontroller.Options{
		Args: append([]string{"--retry-interval-max=1s"}, controllerArgs...)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ctrl.Stop() })
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
		leaseName: e2e.LeaseName("snapshotter", s.Driver.DriverName()),
		class:     s.Namespace + "-class",
		snaps:     snapclientset.NewForConfigOrDie(s.CP.Config()),
		ctrl:      ctrl,
		setup:     csi.NewControllerClient(conn),
	}
	class := &snapv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: sc.class}, Driver: s.Driver.DriverName(),
		DeletionPolicy: snapv1.VolumeSnapshotContentDelete, Parameters: map[string]string{"tier": "gold"}}
	if _, err := sc.snaps.SnapshotV1().VolumeSnapshotClasses().Create(sc.ctx(), class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = sc.snaps.SnapshotV1().VolumeSnapshotClasses().Delete(context.Background(), sc.class, metav1.DeleteOptions{})
	})
	return sc
}

func (s *scenario) ctx() context.Context { return context.Background() }

// start runs `csi-sidecars snapshotter` with fast retries and an API rate limit that does not
// slow a few dozen snapshots down.
func (s *scenario) start(name string, extra ...string) *e2e.Replica {
	s.T.Helper()
	args := append([]string{"--kube-api-qps=200", "--kube-api-burst=400", "--retry-interval-start=100ms", "--retry-interval-max=2s"}, extra...)
	return s.Start(name, []string{"csi-sidecars", "snapshotter"}, args...)
}

// claims creates n volumes in the driver, each with a PV bound to a claim (as
// kube-controller-manager's binder leaves them), and returns the claims' names.
func (s *scenario) claims(n int) []string {
	s.T.Helper()
	ctx := s.ctx()
	names := make([]string, n)
	for i := range n {
		names[i] = fmt.Sprintf("claim-%02d", i)
		rsp, err := s.setup.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("%s-vol-%02d", s.Namespace, i),
			VolumeCapabilities: []*csi.VolumeCapability{{
				AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
			}}})
		if err != nil {
			s.T.Fatal(err)
		}
		pvName := fmt.Sprintf("%s-pv-%02d", s.Namespace, i)
		claim, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Create(ctx, &corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: names[i]},
			Spec: corev1.PersistentVolumeClaimSpec{
				AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
				StorageClassName: ptr.To(""),
				VolumeName:       pvName,
			},
		}, metav1.CreateOptions{})
		if err != nil {
			s.T.Fatal(err)
		}
		pv, err := s.Client.CoreV1().PersistentVolumes().Create(ctx, &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: pvName},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
				VolumeMode:                    ptr.To(corev1.PersistentVolumeFilesystem),
				ClaimRef: &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1",
					Namespace: s.Namespace, Name: claim.Name, UID: claim.UID},
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
					Driver: s.Driver.DriverName(), VolumeHandle: rsp.GetVolume().GetVolumeId()}},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			s.T.Fatal(err)
		}
		pv.Status.Phase = corev1.VolumeBound
		if _, err := s.Client.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
			s.T.Fatal(err)
		}
		claim.Status = corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound,
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}
		if _, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
			s.T.Fatal(err)
		}
	}
	s.T.Cleanup(func() {
		for i := range n {
			_ = s.Client.CoreV1().PersistentVolumes().Delete(context.Background(), fmt.Sprintf("%s-pv-%02d", s.Namespace, i), metav1.DeleteOptions{})
		}
	})
	return names
}

// snapshot creates VolumeSnapshot name of claim, of the scenario's class.
func (s *scenario) snapshot(name, claim string) *snapv1.VolumeSnapshot {
	s.T.Helper()
	vs, err := s.snaps.SnapshotV1().VolumeSnapshots(s.Namespace).Create(s.ctx(), &snapv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: snapv1.VolumeSnapshotSpec{Source: snapv1.VolumeSnapshotSource{PersistentVolumeClaimName: &claim},
			VolumeSnapshotClassName: &s.class},
	}, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return vs
}

func (s *scenario) deleteSnapshot(name string) {
	s.T.Helper()
	if err := s.snaps.SnapshotV1().VolumeSnapshots(s.Namespace).Delete(s.ctx(), name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		s.T.Fatal(err)
	}
}

// volumeSnapshots are the scenario's VolumeSnapshots by name.
func (s *scenario) volumeSnapshots() map[string]snapv1.VolumeSnapshot {
	s.T.Helper()
	list, err := s.snaps.SnapshotV1().VolumeSnapshots(s.Namespace).List(s.ctx(), metav1.ListOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	out := map[string]snapv1.VolumeSnapshot{}
	for _, vs := range list.Items {
		out[vs.Name] = vs
	}
	return out
}

// contents are the driver's VolumeSnapshotContents.
func (s *scenario) contents() []snapv1.VolumeSnapshotContent {
	s.T.Helper()
	list, err := s.snaps.SnapshotV1().VolumeSnapshotContents().List(s.ctx(), metav1.ListOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	var out []snapv1.VolumeSnapshotContent
	for _, c := range list.Items {
		if c.Spec.Driver == s.Driver.DriverName() {
			out = append(out, c)
		}
	}
	return out
}

// waitReady waits until every named VolumeSnapshot is ready to use.
func (s *scenario) waitReady(names ...string) {
	s.T.Helper()
	s.WaitUntil(fmt.Sprintf("%d VolumeSnapshots ready", len(names)), func() bool {
		all := s.volumeSnapshots()
		for _, n := range names {
			vs, ok := all[n]
			if !ok || vs.Status == nil || !ptr.Deref(vs.Status.ReadyToUse, false) {
				return false
			}
		}
		return true
	})
}

// settle waits up to a minute until the backend holds exactly the snapshots of the
// contents, no VolumeSnapshot is left being deleted and every one left is ready: nothing
// stuck, nothing leaked. It tells whether that happened; the caller reports what is off.
func (s *scenario) settle() bool {
	s.T.Helper()
	err := wait.PollUntilContextTimeout(s.ctx(), 100*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		for _, vs := range s.volumeSnapshots() {
			if vs.DeletionTimestamp != nil || vs.Status == nil || !ptr.Deref(vs.Status.ReadyToUse, false) {
				return false, nil
			}
		}
		return len(s.leaked()) == 0 && len(s.contents()) == len(s.volumeSnapshots()), nil
	})
	return err == nil
}

// leaked are the backend's snapshots that no VolumeSnapshotContent records: a leak, once
// nothing is in flight.
func (s *scenario) leaked() []string {
	s.T.Helper()
	recorded := map[string]bool{}
	for _, c := range s.contents() {
		if c.Status != nil && c.Status.SnapshotHandle != nil {
			recorded[*c.Status.SnapshotHandle] = true
		}
	}
	var out []string
	for _, snap := range s.Driver.Snapshots() {
		if snap.GroupSnapshotID == "" && !recorded[snap.ID] {
			out = append(out, snap.ID)
		}
	}
	slices.Sort(out)
	return out
}

// shortLease lets a standby take an unreleased Lease within seconds.
var shortLease = []string{
	"--leader-election-lease-duration=6s",
	"--leader-election-renew-deadline=4s",
	"--leader-election-retry-period=1s",
}

func sinceStart(t0 time.Time) string { return time.Since(t0).Round(time.Millisecond).String() }
