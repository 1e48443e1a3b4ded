package node

import (
	"context"
	"encoding/json"
	"os"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/kubelet"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// nodeIDAnnotation is the kubelet's record of the node's CSI node IDs on its Node: a JSON
// map from driver name to node ID.
const nodeIDAnnotation = "csi.volume.kubernetes.io/nodeid"

// vaNodeIDAnnotation is where the attacher records on a VolumeAttachment the node ID it
// published the volume to.
const vaNodeIDAnnotation = "csi.alpha.kubernetes.io/node-id"

// listsDriver accepts a CSINode that lists driver with nodeID.
func listsDriver(driver, nodeID string) func(*storagev1.CSINode) bool {
	return func(n *storagev1.CSINode) bool {
		d := driverIn(n, driver)
		return d != nil && d.NodeID == nodeID
	}
}

// The kubelet registers the driver through the registrar: the node's CSINode lists it with
// the node ID and the topology key of the driver's NodeGetInfo, and the Node carries the
// node ID in the kubelet's annotation. An attacher then publishes a volume to that node
// with that node ID, which it could only learn from what the kubelet wrote.
func TestKubeletRegistersTheDriverAndTheAttacherPublishesToIt(t *testing.T) {
	t.Parallel()
	e2e.RequireBinaries(t, binDir)
	cp := kube.Get(t)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	k := kubelet.Start(ctx, t, cp, kubelet.Options{})
	const driver = "attach.node.csi.test"
	nodeID := "id-" + k.NodeName()
	s := e2e.NewScenario(t, cp, binDir, driverConfig(driver, nodeID))
	plugin := serveDriver(t, k, s.Driver)
	csiNodes := watchCSINode(ctx, t, s.Client, k.NodeName())

	reg := startRegistrar(t, k, driver, plugin.Socket())
	ok := t.Run("registered", func(t *testing.T) {
		n := csiNodes.until(ctx, "lists "+driver, func(n *storagev1.CSINode) bool { return driverIn(n, driver) != nil })
		t.Logf("driver in CSINode %s after the registrar started", time.Since(reg.started).Round(time.Millisecond))
		d := driverIn(n, driver)
		if d.NodeID != nodeID {
			t.Errorf("CSINode driver node ID = %q, want %q", d.NodeID, nodeID)
		}
		if !slices.Equal(d.TopologyKeys, []string{testdriver.TopologyKey}) {
			t.Errorf("CSINode driver topology keys = %v, want [%s]", d.TopologyKeys, testdriver.TopologyKey)
		}
		if len(s.Driver.Calls(testdriver.MethodNodeGetInfo)) == 0 {
			t.Errorf("the driver was never asked NodeGetInfo")
		}
		node, err := s.Client.CoreV1().Nodes().Get(ctx, k.NodeName(), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var ids map[string]string
		if err := json.Unmarshal([]byte(node.Annotations[nodeIDAnnotation]), &ids); err != nil {
			t.Fatalf("Node annotation %s = %q: %v", nodeIDAnnotation, node.Annotations[nodeIDAnnotation], err)
		}
		if ids[driver] != nodeID {
			t.Errorf("Node annotation %s = %v, want %s: %s", nodeIDAnnotation, ids, driver, nodeID)
		}
		if got := node.Labels[testdriver.TopologyKey]; got != nodeID {
			t.Errorf("Node label %s = %q, want %q", testdriver.TopologyKey, got, nodeID)
		}
		if fi := socketFile(t, reg.socket); fi.Mode().Perm() != 0o700 {
			t.Errorf("registration socket mode %v, want 0700", fi.Mode().Perm())
		}
	})
	if !ok {
		return
	}

	t.Run("attached", func(t *testing.T) {
		a := s.Start("attacher", []string{"csi-sidecars", "attacher"})
		s.WaitForHolder(e2e.LeaseName("attacher", driver), "attacher")
		a.WaitReady(t)
		rsp, err := csi.NewControllerClient(testdriver.Dial(t, s.Driver)).CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: "vol-0",
			VolumeCapabilities: []*csi.VolumeCapability{{
				AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
			}},
		})
		if err != nil {
			t.Fatal(err)
		}
		volumeID := rsp.GetVolume().GetVolumeId()
		pvName, vaName := s.Namespace+"-pv", s.Namespace+"-va"
		pv := &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: pvName},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
					Driver: driver, VolumeHandle: volumeID, FSType: "ext4",
				}},
			},
		}
		if _, err := s.Client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		va := &storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: vaName},
			Spec: storagev1.VolumeAttachmentSpec{
				Attacher: driver,
				NodeName: k.NodeName(),
				Source:   storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName},
			},
		}
		if _, err := s.Client.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		s.WaitUntil("the VolumeAttachment is attached", func() bool {
			got, err := s.Client.StorageV1().VolumeAttachments().Get(ctx, vaName, metav1.GetOptions{})
			return err == nil && got.Status.Attached
		})
		got, err := s.Client.StorageV1().VolumeAttachments().Get(ctx, vaName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got.Annotations[vaNodeIDAnnotation] != nodeID || got.Status.AttachError != nil {
			t.Errorf("VolumeAttachment annotations %v, status %+v; want node ID %s, no error", got.Annotations, got.Status, nodeID)
		}
		publishes := e2e.CallsOn(s.Driver.Journal(), a, testdriver.MethodControllerPublishVolume)
		if !slices.ContainsFunc(publishes, func(c testdriver.Call) bool {
			return c.VolumeID == volumeID && c.NodeID == nodeID && c.Code == "OK"
		}) {
			t.Errorf("ControllerPublishVolume calls %+v, want one of %s to %s", publishes, volumeID, nodeID)
		}
		if v, _ := s.Driver.Volume(volumeID); len(v.Published) != 1 || !hasKey(v.Published, nodeID) {
			t.Errorf("volume %s published to %v, want %s only", volumeID, v.Published, nodeID)
		}

		// Detach, so that the shared control plane is left without the attacher's finalizers.
		if err := s.Client.StorageV1().VolumeAttachments().Delete(ctx, vaName, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		s.WaitUntil("the VolumeAttachment is gone", func() bool {
			_, err := s.Client.StorageV1().VolumeAttachments().Get(ctx, vaName, metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		})
		if v, _ := s.Driver.Volume(volumeID); len(v.Published) != 0 {
			t.Errorf("volume %s still published to %v after the detach", volumeID, v.Published)
		}
		if err := s.Client.CoreV1().PersistentVolumes().Delete(ctx, pvName, metav1.DeleteOptions{}); err != nil {
			t.Error(err)
		}
	})
}

func hasKey[V any](m map[string]V, k string) bool {
	_, ok := m[k]
	return ok
}

// A SIGTERM that reaches the registrar while the kubelet registers the driver (it asked
// GetInfo and waits for the driver's NodeGetInfo before it reports the status) ends the
// registration first: the registrar answers the kubelet's report, exits 0 and leaves its
// socket, and the driver is in the CSINode and stays there. A registrar that exited at once
// would fail the kubelet's report, and the kubelet would take the driver out again.
func TestSIGTERMDuringRegistrationLetsItFinishAndExitsZero(t *testing.T) {
	t.Parallel()
	node := startNode(t, "sigterm.node.csi.test", 3*time.Minute)
	ctx, k, b, plugin, csiNodes := node.ctx, node.kubelet, node.backend, node.plugin, node.csiNodes
	driver, nodeID := node.driver, node.nodeID

	release := b.Hold(testdriver.MethodNodeGetInfo)
	defer release()
	reg := startRegistrar(t, k, driver, plugin.Socket())
	if err := b.WaitFor(ctx, func(calls []testdriver.Call) bool {
		return slices.ContainsFunc(testdriver.CallsOf(calls, testdriver.MethodNodeGetInfo), func(c testdriver.Call) bool { return !c.Done() })
	}); err != nil {
		t.Fatalf("waiting for the kubelet's NodeGetInfo: %v", err)
	}
	t.Logf("the kubelet asked NodeGetInfo %s after the registrar started", time.Since(reg.started).Round(time.Millisecond))
	if d := driverIn(csiNodes.cur, driver); d != nil {
		t.Fatalf("CSINode lists %s before its NodeGetInfo answered: %+v", driver, d)
	}
	placed := socketFile(t, reg.socket)

	reg.signal(t, syscall.SIGTERM)
	reg.waitDraining(ctx, t)
	if !reg.running() {
		t.Fatalf("the registrar exited (code %d) before the kubelet's registration ended", reg.exitCode())
	}
	released := time.Now()
	release()
	if code := reg.wait(t, 30*time.Second); code != 0 {
		t.Errorf("the registrar exited %d after a SIGTERM, want 0", code)
	}
	t.Logf("the registrar exited %s after the NodeGetInfo was released", time.Since(released).Round(time.Millisecond))
	csiNodes.until(ctx, "lists "+driver+" with "+nodeID, listsDriver(driver, nodeID))
	t.Logf("driver in CSINode %s after the NodeGetInfo was released", time.Since(released).Round(time.Millisecond))
	if fi := socketFile(t, reg.socket); !os.SameFile(fi, placed) {
		t.Errorf("registration socket replaced after the SIGTERM")
	}
	// The kubelet takes a driver out at once when the report fails, and its plugin manager
	// reconciles every second: a few seconds of no change shows that nothing does.
	csiNodes.holds(ctx, 3*time.Second, "lists "+driver, listsDriver(driver, nodeID))
	if fi := socketFile(t, reg.socket); !os.SameFile(fi, placed) {
		t.Errorf("registration socket replaced after the registrar exited")
	}
}

// The kubelet registers the driver again through the registrar that still runs after the
// kubelet restarts, and through a new registrar after the old one was SIGKILLed: the new
// one replaces the socket the dead one left, and the kubelet registers the driver anew.
func TestDriverIsRegisteredAgainAfterKubeletRestartAndRegistrarKill(t *testing.T) {
	t.Parallel()
	node := startNode(t, "restart.node.csi.test", 4*time.Minute)
	ctx, client, k, b, plugin, csiNodes := node.ctx, node.client, node.kubelet, node.backend, node.plugin, node.csiNodes
	driver, nodeID := node.driver, node.nodeID
	reg := startRegistrar(t, k, driver, plugin.Socket())
	csiNodes.until(ctx, "lists "+driver, listsDriver(driver, nodeID))
	t.Logf("driver in CSINode %s after the registrar started", time.Since(reg.started).Round(time.Millisecond))
	placed := socketFile(t, reg.socket)

	t.Run("kubelet restart", func(t *testing.T) {
		if err := k.Stop(); err != nil {
			t.Fatal(err)
		}
		// A restarted kubelet leaves a CSINode entry that is already right as it is: take
		// the driver out while no kubelet runs, so that only a new registration puts it back.
		removeDriver(ctx, t, client, k.NodeName(), driver)
		csiNodes.until(ctx, "no longer lists "+driver, func(n *storagev1.CSINode) bool { return driverIn(n, driver) == nil })
		restarted := time.Now()
		if err := k.Restart(ctx); err != nil {
			t.Fatal(err)
		}
		nodeGetInfoSince(ctx, t, b, restarted)
		csiNodes.until(ctx, "lists "+driver+" again", listsDriver(driver, nodeID))
		t.Logf("driver back in CSINode %s after the kubelet was started again", time.Since(restarted).Round(time.Millisecond))
		if !reg.running() {
			t.Errorf("the registrar exited (code %d) during the kubelet's restart", reg.exitCode())
		}
		if fi := socketFile(t, reg.socket); !os.SameFile(fi, placed) {
			t.Errorf("the running registrar replaced its socket during the kubelet's restart")
		}
	})

	t.Run("registrar SIGKILL", func(t *testing.T) {
		if err := reg.child.Stop(); err != nil { // SIGKILL
			t.Fatal(err)
		}
		stale := socketFile(t, reg.socket)
		if live, err := answers(reg.socket); err != nil || live {
			t.Fatalf("the killed registrar's socket answers (%v, %v), want a stale socket", live, err)
		}
		mark, err := client.StorageV1().CSINodes().Get(ctx, k.NodeName(), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		next := startRegistrar(t, k, driver, plugin.Socket())
		call := nodeGetInfoSince(ctx, t, b, next.started)
		// The kubelet sees a new socket: it unregisters the driver of the old one and
		// registers it again; the entry it writes last lists the driver.
		n := csiNodes.untilWrittenAfter(ctx, mark.ResourceVersion, "lists "+driver, listsDriver(driver, nodeID))
		t.Logf("driver written to CSINode %s after the new registrar started (NodeGetInfo after %s)",
			time.Since(next.started).Round(time.Millisecond), call.Start.Sub(next.started).Round(time.Millisecond))
		if d := driverIn(n, driver); !slices.Equal(d.TopologyKeys, []string{testdriver.TopologyKey}) {
			t.Errorf("CSINode driver topology keys = %v, want [%s]", d.TopologyKeys, testdriver.TopologyKey)
		}
		fi := socketFile(t, next.socket)
		if os.SameFile(fi, stale) {
			t.Errorf("the new registrar kept the stale socket")
		}
		if live, err := answers(next.socket); err != nil || !live {
			t.Errorf("the new registrar's socket does not answer (%v)", err)
		}
		if !next.running() {
			t.Errorf("the new registrar exited (code %d)", next.exitCode())
		}
	})
}

// removeDriver takes driver out of node's CSINode.
func removeDriver(ctx context.Context, t *testing.T, client kubernetes.Interface, node, driver string) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := client.StorageV1().CSINodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		n.Spec.Drivers = slices.DeleteFunc(n.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == driver })
		_, err = client.StorageV1().CSINodes().Update(ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("taking %s out of CSINode %s: %v", driver, node, err)
	}
}
