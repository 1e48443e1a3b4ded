package scale

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

const (
	// freshVolumes is the fresh work per sidecar: twice the workers each replica runs, so
	// that half is in flight on the leader at the SIGTERM and half is left for the standby.
	freshVolumes = 20
	workers      = freshVolumes / 2
	// driverLatency is how long each CreateVolume, ControllerPublishVolume and
	// ControllerExpandVolume takes once the world is set up.
	driverLatency = 1500 * time.Millisecond
	// setupQPS and setupWorkers bound the test's own bulk writes.
	setupQPS     = 1000
	setupWorkers = 32
)

// world is a cluster with many settled volumes of one test driver: n PersistentVolumes
// provisioned by the driver and bound to n claims (nothing left for the provisioner or
// the resizer), each attached to the node by a VolumeAttachment that says so, with the
// attacher's finalizers on it and on the PersistentVolume (nothing left for the attacher),
// the driver agreeing with all of it (nothing for the attacher's ListVolumes reconciler).
// On top, freshVolumes bound pairs that are not attached yet, for the attacher's and the
// resizer's fresh work.
type world struct {
	*e2e.Scenario
	store  e2e.Storage
	nodeID string
	// settled is how many settled volumes there are.
	settled int
	// setup is how long creating them took: in the driver, then in the API.
	driverSetup, apiSetup time.Duration
}

// Object names: settled volume i is claim s-<i>, PersistentVolume and VolumeAttachment
// <namespace>-s-<i>; fresh volume j is claim f-<j>, PersistentVolume <namespace>-f-<j>.
func settledClaim(i int) string         { return fmt.Sprintf("s-%05d", i) }
func freshClaim(j int) string           { return fmt.Sprintf("f-%02d", j) }
func (w *world) settledPV(i int) string { return fmt.Sprintf("%s-s-%05d", w.Namespace, i) }
func (w *world) freshPV(j int) string   { return fmt.Sprintf("%s-f-%02d", w.Namespace, j) }

// isSettled tells whether a request was about one of the settled objects (or the settled
// claim's or PersistentVolume's status).
func (w *world) isSettled(e audit.Event) bool {
	if e.ObjectRef == nil {
		return false
	}
	switch e.ObjectRef.Resource {
	case "persistentvolumeclaims":
		return e.ObjectRef.Namespace == w.Namespace && strings.HasPrefix(e.ObjectRef.Name, "s-")
	case "persistentvolumes", "volumeattachments":
		return strings.HasPrefix(e.ObjectRef.Name, w.Namespace+"-s-")
	}
	return false
}

// setupTime says how long creating the settled volumes took.
func (w *world) setupTime() string {
	return fmt.Sprintf("%v in the driver, %v in the API", w.driverSetup.Round(10*time.Millisecond), w.apiSetup.Round(10*time.Millisecond))
}

func (w *world) attacherFinalizer() string {
	return "external-attacher/" + lifecycle.SanitizeName(w.Driver.DriverName())
}

// newWorld builds the world with n settled volumes; the driver is slow only afterwards.
func newWorld(t testing.TB, n int) *world {
	t.Helper()
	s := e2e.NewScenario(t, kube.Get(t), binDir, testdriver.Config{})
	// The harness's client has client-go's default limit (5/s); the setup writes tens of
	// thousands of objects, and the waits poll.
	cfg := rest.CopyConfig(s.CP.Config())
	cfg.QPS, cfg.Burst = setupQPS, 2*setupQPS
	cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	cfg.ContentType = runtime.ContentTypeProtobuf
	s.Client = kubernetes.NewForConfigOrDie(cfg)
	w := &world{
		Scenario: s,
		nodeID:   s.Namespace + "-node-id",
		settled:  n,
		store: e2e.Storage{Kube: s.Client, Namespace: s.Namespace, Class: s.Namespace,
			Node: s.Namespace + "-node", Driver: s.Driver.DriverName()},
	}
	ctx := context.Background()
	if err := w.store.SetUp(ctx, w.nodeID); err != nil {
		t.Fatal(err)
	}

	began := time.Now()
	handles := w.createBackendVolumes(n)
	w.driverSetup = time.Since(began)

	began = time.Now()
	parallel(t, n+freshVolumes, func(i int) error {
		if i < n {
			return w.createVolume(ctx, settledClaim(i), w.settledPV(i), handles[i], true)
		}
		j := i - n
		return w.createVolume(ctx, freshClaim(j), w.freshPV(j), handles[i], false)
	})
	w.apiSetup = time.Since(began)

	for _, m := range []string{testdriver.MethodCreateVolume, testdriver.MethodControllerPublishVolume, testdriver.MethodControllerExpandVolume} {
		w.Driver.SetMethodLatency(m, driverLatency)
	}
	return w
}

// createBackendVolumes creates the n settled volumes in the driver, published to the node,
// and the fresh ones, unpublished; it returns their handles, the settled ones first.
func (w *world) createBackendVolumes(n int) []string {
	w.T.Helper()
	srv, err := w.Driver.Serve(filepath.Join(w.Dir, "setup.sock"))
	if err != nil {
		w.T.Fatal(err)
	}
	w.T.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(srv.Endpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		w.T.Fatal(err)
	}
	defer conn.Close()
	driver := csi.NewControllerClient(conn)
	capability := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	handles := make([]string, n+freshVolumes)
	ctx := context.Background()
	parallel(w.T, n+freshVolumes, func(i int) error {
		name := w.settledPV(i)
		if i >= n {
			name = w.freshPV(i - n)
		}
		rsp, err := driver.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{capability},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}})
		if err != nil {
			return fmt.Errorf("creating volume %s: %w", name, err)
		}
		handles[i] = rsp.GetVolume().GetVolumeId()
		if i >= n {
			return nil
		}
		_, err = driver.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: handles[i], NodeId: w.nodeID, VolumeCapability: capability})
		return err
	})
	return handles
}

// createVolume creates a claim and its PersistentVolume as the provisioner and the PV
// controller leave them, bound; attached, also the VolumeAttachment as the attach/detach
// controller creates it and the attacher leaves it.
func (w *world) createVolume(ctx context.Context, claimName, pvName, handle string, attached bool) error {
	kube, driver, ns := w.Client, w.Driver.DriverName(), w.Namespace
	size := resource.MustParse("1Gi")
	modes := []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce}
	claim, err := kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: claimName, Annotations: map[string]string{
			volumehelpers.AnnBindCompleted:          "yes",
			volumehelpers.AnnBoundByController:      "yes",
			volumehelpers.AnnStorageProvisioner:     driver,
			volumehelpers.AnnBetaStorageProvisioner: driver,
		}},
		Spec: v1.PersistentVolumeClaimSpec{
			AccessModes:      modes,
			StorageClassName: ptr.To(w.store.Class),
			VolumeName:       pvName,
			Resources:        v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: size}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("creating claim %s: %w", claimName, err)
	}
	// The provisioner's finalizer goes on every bound PersistentVolume with reclaim policy
	// Delete; the attacher's on those it attached.
	finalizers := []string{volumehelpers.PVDeletionProtectionFinalizer}
	if attached {
		finalizers = append(finalizers, w.attacherFinalizer())
	}
	pv, err := kube.CoreV1().PersistentVolumes().Create(ctx, &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName, Finalizers: finalizers, Annotations: map[string]string{
			volumehelpers.AnnDynamicallyProvisioned:                      driver,
			"volume.kubernetes.io/provisioner-deletion-secret-name":      "",
			"volume.kubernetes.io/provisioner-deletion-secret-namespace": "",
		}},
		Spec: v1.PersistentVolumeSpec{
			AccessModes:                   modes,
			Capacity:                      v1.ResourceList{v1.ResourceStorage: size},
			PersistentVolumeReclaimPolicy: v1.PersistentVolumeReclaimDelete,
			StorageClassName:              w.store.Class,
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
				Driver: driver, VolumeHandle: handle,
				VolumeAttributes: map[string]string{"storage.kubernetes.io/csiProvisionerIdentity": "scale-" + driver},
			}},
			ClaimRef: &v1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: ns, Name: claimName,
				UID: claim.UID, ResourceVersion: claim.ResourceVersion},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("creating PersistentVolume %s: %w", pvName, err)
	}
	pv.Status.Phase = v1.VolumeBound
	if _, err := kube.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("binding PersistentVolume %s: %w", pvName, err)
	}
	claim.Status = v1.PersistentVolumeClaimStatus{Phase: v1.ClaimBound, AccessModes: modes, Capacity: v1.ResourceList{v1.ResourceStorage: size}}
	if _, err := kube.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("binding claim %s: %w", claimName, err)
	}
	if !attached {
		return nil
	}
	va, err := kube.StorageV1().VolumeAttachments().Create(ctx, &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: pvName, Finalizers: []string{w.attacherFinalizer()},
			Annotations: map[string]string{"csi.alpha.kubernetes.io/node-id": w.nodeID}},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: driver, NodeName: w.store.Node,
			Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(pvName)}},
	}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("creating VolumeAttachment %s: %w", pvName, err)
	}
	va.Status = storagev1.VolumeAttachmentStatus{Attached: true,
		AttachmentMetadata: map[string]string{testdriver.PublishContextDevicePath: "/dev/testdriver/" + handle}}
	if _, err := kube.StorageV1().VolumeAttachments().UpdateStatus(ctx, va, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("marking VolumeAttachment %s attached: %w", pvName, err)
	}
	return nil
}

// parallel runs do(0..n-1) on setupWorkers goroutines and fails t with the first error.
func parallel(t testing.TB, n int, do func(i int) error) {
	t.Helper()
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
		next  = make(chan int)
	)
	for range min(setupWorkers, n) {
		wg.Go(func() {
			for i := range next {
				if err := do(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
		})
	}
	for i := range n {
		mu.Lock()
		failed := first != nil
		mu.Unlock()
		if failed {
			break
		}
		next <- i
	}
	close(next)
	wg.Wait()
	if first != nil {
		t.Fatal(first)
	}
}
