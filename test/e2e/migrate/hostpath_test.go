package migrate

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cluster"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/kubelet"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/snapshotcontroller"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

const (
	// hostpathManifest is csi-driver-host-path v1.18.0's plugin StatefulSet as migrate
	// wrote it (the golden output of migrate's tests).
	hostpathManifest = "../../../migrate/testdata/hostpath.out.yaml"
	hostpathPlugin   = "csi-hostpathplugin"
	// hostpathPod is the name of the StatefulSet's one pod: the containers' host name.
	hostpathPod = hostpathPlugin + "-0"
	// hostpathSocketDir holds the plugin's socket on the host (its socket-dir volume), below the
	// kubelet's plugins folder; the containers mount that folder at /csi.
	hostpathSocketDir = "csi-hostpath"
	mergedControllers = "--controllers=node-driver-registrar,livenessprobe,attacher,provisioner,resizer,snapshotter"
)

// hostpathContainers are the csi-sidecars containers of the migrated StatefulSet: the one
// that merged six sidecars, and the health monitor, which migrate kept apart.
func hostpathContainers(t *testing.T) (merged, monitor corev1.Container) {
	t.Helper()
	raw, err := os.ReadFile(hostpathManifest)
	if err != nil {
		t.Fatal(err)
	}
	pod, err := e2e.PodSpec(raw, "StatefulSet", hostpathPlugin)
	if err != nil {
		t.Fatal(err)
	}
	var found int
	for _, c := range pod.Spec.Containers {
		switch {
		case !strings.HasPrefix(c.Image, "csi-sidecars:"):
		case slices.Contains(c.Args, mergedControllers):
			merged, found = c, found+1
		case len(c.Args) > 0 && c.Args[0] == "health-monitor":
			monitor, found = c, found+1
		default:
			t.Fatalf("container %s runs csi-sidecars %q: neither the merged container nor the health monitor", c.Name, c.Args)
		}
	}
	if found != 2 || merged.Name == "" || monitor.Name == "" {
		t.Fatalf("%s: want one csi-sidecars container with %s and one health monitor; have %d", hostpathManifest, mergedControllers, found)
	}
	return merged, monitor
}

// The migrated csi-driver-host-path plugin does every job of the six sidecars it merged,
// once each, against the real control loop: the registrar registers the driver with a
// real kubelet (its CSINode lists it), the livenessprobe answers on its port, and a Pod's
// claim is provisioned, attached, grown, snapshotted, restored to a new claim and deleted,
// each by one successful driver call on the merged process's socket. The health monitor,
// kept apart, leads its Lease.
func TestMigratedHostpathPluginDoesEveryJob(t *testing.T) {
	e2e.RequireBinaries(t, binDir)
	for _, assets := range []func() (string, error){cluster.Assets, snapshotcontroller.Assets, kubelet.Assets} {
		if _, err := assets(); err != nil {
			t.Skip(err)
		}
	}
	if err := e2e.HostNames(); err != nil {
		t.Skipf("the pod's containers take their identity from its host name: %v", err)
	}
	merged, monitor := hostpathContainers(t)
	cp := kube.Get(t)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()

	// The snapshot-controller first: it installs the VolumeSnapshot CRDs, which the
	// provisioner and the snapshotter look for when they start.
	snapCtl, err := snapshotcontroller.Start(ctx, cp, snapshotcontroller.Options{Args: []string{"--kube-api-qps=100", "--kube-api-burst=200"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = snapCtl.Stop() })
	// The kubelet of the node the plugin's pod runs on. Pods with claims go to the control
	// loop's fake nodes: the hollow kubelet runs no container, so it takes none.
	k := kubelet.Start(ctx, t, cp, kubelet.Options{})
	s := e2e.NewScenario(t, cp, binDir, testdriver.Config{Topology: true, NodeID: "id-" + k.NodeName(),
		ControllerCapabilities: append(testdriver.DefaultControllerCapabilities(),
			csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT, csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
			csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH)})
	cordon(ctx, t, s, k.NodeName())
	driver := s.Driver.DriverName()
	// The hostpath plugin's socket on the host, where the kubelet reaches the driver.
	hostSocket := filepath.Join(k.PluginsDir(), hostpathSocketDir, "csi.sock")
	if err := os.MkdirAll(filepath.Dir(hostSocket), 0o750); err != nil {
		t.Fatal(err)
	}
	plugin, err := s.Driver.Serve(hostSocket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(plugin.Stop)

	// What the pod's downward API gives its containers.
	fields := map[string]string{"spec.nodeName": k.NodeName(), "metadata.name": hostpathPod, "metadata.namespace": s.Namespace}
	healthPort := e2e.FreePort(t)
	sidecars := s.StartCommand("csi-sidecars", func(ep e2e.Endpoints) e2e.Command {
		env, err := e2e.ContainerEnv(merged, fields)
		if err != nil {
			t.Fatal(err)
		}
		args, err := e2e.SetFlags(e2e.ExpandArgs(merged.Args, env), map[string]string{
			"csi-address":               ep.CSI,
			"http-endpoint":             ep.HTTP,
			"livenessprobe-health-port": healthPort,
			"node-driver-registrar-kubelet-registration-path": hostSocket,
		})
		if err != nil {
			t.Fatal(err)
		}
		// In the pod: the in-cluster config, and the kubelet's registration folder mounted
		// where the registrar looks by default (/registration).
		args = append(args, "--kubeconfig="+ep.Kubeconfig, "--node-driver-registrar-plugin-registration-path="+k.RegistrationDir())
		return e2e.Command{Binary: "csi-sidecars", Args: args, Env: e2e.EnvList(merged, env), Host: hostpathPod}
	})
	healthMonitor := s.StartCommand("health-monitor", func(ep e2e.Endpoints) e2e.Command {
		env, err := e2e.ContainerEnv(monitor, fields)
		if err != nil {
			t.Fatal(err)
		}
		if env["ADDRESS"] == "" {
			t.Fatalf("the health monitor's container has no ADDRESS: env %v", monitor.Env)
		}
		env["ADDRESS"] = ep.Socket
		// In the pod: the in-cluster config, whose namespace the Lease goes to.
		args := append(e2e.ExpandArgs(monitor.Args, env), "--kubeconfig="+ep.Kubeconfig, "--leader-election-namespace="+s.Namespace)
		return e2e.Command{Binary: "csi-sidecars", Args: args, Env: e2e.EnvList(monitor, env), Host: hostpathPod}
	})

	loop, err := cluster.Start(ctx, cp, cluster.Options{Nodes: 1, NodePrefix: s.Namespace, Driver: driver,
		NodeID: func(node string) string { return node + "-id" }, TopologyKey: testdriver.TopologyKey})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := loop.Stop(); err != nil {
			t.Errorf("stopping the control loop: %v", err)
		}
	})
	work, err := cluster.NewWorkload(ctx, s.Client, cluster.WorkloadOptions{Namespace: s.Namespace, Driver: driver})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(work.Close)
	sidecars.WaitReady(t)

	j := &journal{t: t, s: s, r: sidecars}
	t.Run("registrar", func(t *testing.T) {
		s.WaitUntil("the kubelet's CSINode lists "+driver, func() bool {
			n, err := s.Client.StorageV1().CSINodes().Get(ctx, k.NodeName(), metav1.GetOptions{})
			return err == nil && slices.ContainsFunc(n.Spec.Drivers, func(d storagev1.CSINodeDriver) bool {
				return d.Name == driver && d.NodeID == s.Driver.NodeID()
			})
		})
		if !slices.ContainsFunc(s.Driver.Calls(testdriver.MethodNodeGetInfo), func(c testdriver.Call) bool { return c.Socket == plugin.Socket() }) {
			t.Errorf("the kubelet never asked NodeGetInfo on %s, the socket the registrar told it", hostSocket)
		}
	})
	t.Run("livenessprobe", func(t *testing.T) {
		before := len(e2e.CallsOn(s.Driver.Journal(), sidecars, testdriver.MethodProbe))
		rsp, err := http.Get("http://127.0.0.1:" + healthPort + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		rsp.Body.Close()
		if rsp.StatusCode != http.StatusOK {
			t.Errorf("/healthz on --livenessprobe-health-port: %d, want 200", rsp.StatusCode)
		}
		if after := len(e2e.CallsOn(s.Driver.Journal(), sidecars, testdriver.MethodProbe)); after <= before {
			t.Errorf("/healthz answered without a Probe call on the driver")
		}
	})
	t.Run("health monitor", func(t *testing.T) {
		s.WaitForHolder(e2e.LeaseName("health-monitor", driver), hostpathPod)
		if !healthMonitor.Running() {
			t.Errorf("the health monitor exited with %d", healthMonitor.ExitCode)
		}
	})

	waitStage := func(stage cluster.Stage, name string) {
		t.Helper()
		wctx, wcancel := context.WithTimeout(ctx, time.Minute)
		defer wcancel()
		if err := work.Wait(wctx, stage, name); err != nil {
			t.Fatal(err)
		}
	}
	const app = "app"
	if err := work.CreatePod(ctx, app); err != nil {
		t.Fatal(err)
	}
	waitStage(cluster.Attached, app)
	it, _ := work.Item(app)
	j.once("provision", testdriver.MethodCreateVolume, func(c testdriver.Call) bool { return c.VolumeName == it.PersistentVolume })
	j.once("attach", testdriver.MethodControllerPublishVolume, func(c testdriver.Call) bool {
		return c.VolumeID == it.VolumeHandle && c.NodeID == it.Node+"-id"
	})

	if err := work.Grow(ctx, app, "2Gi"); err != nil {
		t.Fatal(err)
	}
	waitStage(cluster.Grown, app)
	j.once("resize", testdriver.MethodControllerExpandVolume, func(c testdriver.Call) bool { return c.VolumeID == it.VolumeHandle })
	if v, _ := s.Driver.Volume(it.VolumeHandle); v.CapacityBytes < 2<<30 {
		t.Errorf("volume %s has %d bytes after the resize, want 2Gi", it.VolumeHandle, v.CapacityBytes)
	}

	// A snapshot of the claim, and a new claim restored from it.
	snaps := snapclientset.NewForConfigOrDie(cp.Config())
	snapHandle := snapshot(ctx, t, s, snaps, app)
	j.once("snapshot", testdriver.MethodCreateSnapshot, func(c testdriver.Call) bool {
		return c.VolumeID == it.VolumeHandle && c.SnapshotID == snapHandle
	})
	restored := restore(ctx, t, s, app)
	j.once("restore", testdriver.MethodCreateVolume, func(c testdriver.Call) bool { return c.VolumeName == restored.Name })
	if v, ok := s.Driver.Volume(restored.Spec.CSI.VolumeHandle); !ok || v.ContentSource.GetSnapshot().GetSnapshotId() != snapHandle {
		t.Errorf("restored volume %s: content source %v, want snapshot %s", restored.Spec.CSI.VolumeHandle, v.ContentSource, snapHandle)
	}

	// Deleted: the restored claim, the snapshot, the Pod (detached) and its claim.
	if err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Delete(ctx, "restored", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the restored volume is deleted", func() bool {
		_, err := s.Client.CoreV1().PersistentVolumes().Get(ctx, restored.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	j.once("delete the restored volume", testdriver.MethodDeleteVolume, func(c testdriver.Call) bool {
		return c.VolumeID == restored.Spec.CSI.VolumeHandle
	})
	if err := snaps.SnapshotV1().VolumeSnapshots(s.Namespace).Delete(ctx, app, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the driver's snapshot is deleted", func() bool { _, ok := s.Driver.Snapshot(snapHandle); return !ok })
	j.once("delete the snapshot", testdriver.MethodDeleteSnapshot, func(c testdriver.Call) bool { return c.SnapshotID == snapHandle })
	if err := work.DeletePod(ctx, app); err != nil {
		t.Fatal(err)
	}
	waitStage(cluster.Detached, app)
	j.once("detach", testdriver.MethodControllerUnpublishVolume, func(c testdriver.Call) bool { return c.VolumeID == it.VolumeHandle })
	if err := work.DeleteClaim(ctx, app); err != nil {
		t.Fatal(err)
	}
	waitStage(cluster.VolumeDeleted, app)
	j.once("delete", testdriver.MethodDeleteVolume, func(c testdriver.Call) bool { return c.VolumeID == it.VolumeHandle })
	if vs, ss := s.Driver.Volumes(), s.Driver.Snapshots(); len(vs) != 0 || len(ss) != 0 {
		t.Errorf("left in the driver: volumes %+v, snapshots %+v", vs, ss)
	}
	for _, o := range s.Driver.Overlaps() {
		t.Errorf("volume %s: %s and %s at once", o.Volume, o.First.Method, o.Second.Method)
	}
	for _, r := range []*e2e.Replica{sidecars, healthMonitor} {
		if !r.Running() {
			t.Errorf("%s exited with %d", r.Name, r.ExitCode)
		}
	}
	if err := loop.Running(); err != nil {
		t.Error(err)
	}
}

// journal checks the driver's calls on one replica's socket.
type journal struct {
	t *testing.T
	s *e2e.Scenario
	r *e2e.Replica
}

// once checks that exactly one call of method that matches succeeded on the replica's
// socket, and that no call of method on another socket matches.
func (j *journal) once(what, method string, match func(testdriver.Call) bool) {
	j.t.Helper()
	ok, elsewhere := 0, 0
	for _, c := range j.s.Driver.Calls(method) {
		switch {
		case !match(c):
		case c.Socket != j.r.Socket:
			elsewhere++
		case c.Code == "OK" && !c.Canceled:
			ok++
		}
	}
	if ok != 1 || elsewhere != 0 {
		j.t.Errorf("%s: %d successful %s calls on %s's socket, %d on others; want exactly one, by %s", what, ok, method, j.r.Name, elsewhere, j.r.Name)
	}
}

// cordon marks a node unschedulable, as kubectl cordon does.
func cordon(ctx context.Context, t *testing.T, s *e2e.Scenario, node string) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := s.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		n.Spec.Unschedulable = true
		_, err = s.Client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("cordoning node %s: %v", node, err)
	}
}

// snapshot takes VolumeSnapshot <claim> of claim, of a new class of the driver, waits
// until it is ready and returns the driver's snapshot handle.
func snapshot(ctx context.Context, t *testing.T, s *e2e.Scenario, snaps snapclientset.Interface, claim string) string {
	t.Helper()
	class := s.Namespace
	if _, err := snaps.SnapshotV1().VolumeSnapshotClasses().Create(ctx, &snapv1.VolumeSnapshotClass{
		ObjectMeta: metav1.ObjectMeta{Name: class}, Driver: s.Driver.DriverName(), DeletionPolicy: snapv1.VolumeSnapshotContentDelete,
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = snaps.SnapshotV1().VolumeSnapshotClasses().Delete(context.Background(), class, metav1.DeleteOptions{})
	})
	if _, err := snaps.SnapshotV1().VolumeSnapshots(s.Namespace).Create(ctx, &snapv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: claim},
		Spec: snapv1.VolumeSnapshotSpec{Source: snapv1.VolumeSnapshotSource{PersistentVolumeClaimName: &claim},
			VolumeSnapshotClassName: &class},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var handle string
	s.WaitUntil("VolumeSnapshot "+claim+" is ready", func() bool {
		vs, err := snaps.SnapshotV1().VolumeSnapshots(s.Namespace).Get(ctx, claim, metav1.GetOptions{})
		if err != nil || vs.Status == nil || !ptr.Deref(vs.Status.ReadyToUse, false) || vs.Status.BoundVolumeSnapshotContentName == nil {
			return false
		}
		content, err := snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, *vs.Status.BoundVolumeSnapshotContentName, metav1.GetOptions{})
		if err != nil || content.Status == nil || content.Status.SnapshotHandle == nil {
			return false
		}
		handle = *content.Status.SnapshotHandle
		return true
	})
	return handle
}

// restore creates claim "restored" from VolumeSnapshot <snapshot>, of a StorageClass of
// the driver that binds at once, and returns its PersistentVolume once it is bound.
func restore(ctx context.Context, t *testing.T, s *e2e.Scenario, snapshot string) *corev1.PersistentVolume {
	t.Helper()
	class := s.Namespace + "-immediate"
	if _, err := s.Client.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: class}, Provisioner: s.Driver.DriverName(),
		ReclaimPolicy: ptr.To(corev1.PersistentVolumeReclaimDelete), VolumeBindingMode: ptr.To(storagev1.VolumeBindingImmediate),
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = s.Client.StorageV1().StorageClasses().Delete(context.Background(), class, metav1.DeleteOptions{})
	})
	if _, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Create(ctx, &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "restored"},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: &class,
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("2Gi")}},
			DataSource:       &corev1.TypedLocalObjectReference{APIGroup: ptr.To(snapv1.GroupName), Kind: "VolumeSnapshot", Name: snapshot},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var pv *corev1.PersistentVolume
	s.WaitUntil("claim restored is bound", func() bool {
		pvc, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Get(ctx, "restored", metav1.GetOptions{})
		if err != nil || pvc.Status.Phase != corev1.ClaimBound {
			return false
		}
		pv, err = s.Client.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		return err == nil && pv.Spec.CSI != nil
	})
	return pv
}
