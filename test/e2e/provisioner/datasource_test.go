package provisioner

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

const (
	cloneFinalizer    = "provisioner.storage.kubernetes.io/cloning-protection"
	snapshotFinalizer = "provisioner.storage.kubernetes.io/volumesnapshot-as-source-protection"
)

// withCapabilities is the default capabilities of the test driver plus extra.
func withCapabilities(extra ...csi.ControllerServiceCapability_RPC_Type) []csi.ControllerServiceCapability_RPC_Type {
	return append(testdriver.DefaultControllerCapabilities(), extra...)
}

// provisionBoundSource creates claim name of class, waits for its PersistentVolume and
// binds both as the PV controller would; it returns the volume's handle.
func (s *scenario) provisionBoundSource(name, class string) string {
	s.T.Helper()
	c := s.createClaim(name, class, "")
	pvName := "pvc-" + string(c.UID)
	s.WaitUntil("the source's PersistentVolume", func() bool { return s.pvs()[pvName] != nil })
	pv := s.pvs()[pvName]
	st := e2e.Storage{Kube: s.Client, Namespace: s.Namespace, Driver: s.driver}
	if err := st.Bind(s.ctx(), pv); err != nil {
		s.T.Fatal(err)
	}
	return pv.Spec.CSI.VolumeHandle
}

// createClaimFrom creates a claim of class whose data source is source.
func (s *scenario) createClaimFrom(name, class string, source v1.TypedLocalObjectReference) *v1.PersistentVolumeClaim {
	s.T.Helper()
	claim := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{"volume.kubernetes.io/storage-provisioner": s.driver}},
		Spec: v1.PersistentVolumeClaimSpec{
			AccessModes:      []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			StorageClassName: &class,
			Resources:        v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
			DataSource:       &source,
		},
	}
	claim, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Create(s.ctx(), claim, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return claim
}

func (s *scenario) claimFinalizers(name string) []string {
	c, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Get(s.ctx(), name, metav1.GetOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return c.Finalizers
}

// checkMadeFrom asserts that each named claim has one PersistentVolume whose volume in the
// driver was made from the source.
func (s *scenario) checkMadeFrom(claims []*v1.PersistentVolumeClaim, from func(*csi.VolumeContentSource) bool) {
	s.T.Helper()
	byClaim := s.pvsByClaim()
	for _, c := range claims {
		pvs := byClaim[c.UID]
		if len(pvs) != 1 {
			s.T.Errorf("claim %s has %d PersistentVolumes, want 1", c.Name, len(pvs))
			continue
		}
		v, ok := s.Driver.Volume(pvs[0].Spec.CSI.VolumeHandle)
		if !ok || !from(v.ContentSource) {
			s.T.Errorf("claim %s: volume %s made from %v", c.Name, pvs[0].Spec.CSI.VolumeHandle, v.ContentSource)
		}
	}
}

// Ten clones of one bound claim get volumes cloned from its volume; the source carries the
// cloning finalizer while they are made and loses it once they all are.
func TestClonesTenVolumesAndProtectsTheSourceMeanwhile(t *testing.T) {
	s := newScenario(t, testdriver.Config{ControllerCapabilities: withCapabilities(csi.ControllerServiceCapability_RPC_CLONE_VOLUME)})
	fast := s.createClass("fast", nil)
	s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	srcHandle := s.provisionBoundSource("src", fast.Name)

	// The clones are held in the driver until the finalizer has been seen on the source.
	release := s.Driver.Hold(testdriver.MethodCreateVolume)
	t.Cleanup(release)
	start := time.Now()
	var clones []*v1.PersistentVolumeClaim
	for i := range 10 {
		clones = append(clones, s.createClaimFrom(fmt.Sprintf("clone-%02d", i), fast.Name, v1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "src"}))
	}
	s.WaitUntil("the cloning finalizer on the source", func() bool { return slices.Contains(s.claimFinalizers("src"), cloneFinalizer) })
	release()
	s.waitForPVs(11)
	t.Logf("FIGURE 10 clones provisioned in %v", time.Since(start))
	s.WaitUntil("the cloning finalizer gone", func() bool { return !slices.Contains(s.claimFinalizers("src"), cloneFinalizer) })
	t.Logf("FIGURE cloning finalizer removed %v after the clones started", time.Since(start))
	s.checkMadeFrom(clones, func(src *csi.VolumeContentSource) bool { return src.GetVolume().GetVolumeId() == srcHandle })
	s.checkEveryVolumeHasExactlyOnePV()
}

// A clone whose source is in another StorageClass of the driver is provisioned from the
// source's volume, as upstream allows since it dropped the same-class check; a clone whose
// source's volume is another driver's is refused with an event, no volume and no finalizer
// on that source.
func TestACloneFromAnotherClassOfTheDriverIsProvisionedAndOneOfAnotherDriverRefused(t *testing.T) {
	s := newScenario(t, testdriver.Config{ControllerCapabilities: withCapabilities(csi.ControllerServiceCapability_RPC_CLONE_VOLUME)})
	fast := s.createClass("fast", nil)
	slow := s.createClass("slow", nil)
	s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	srcHandle := s.provisionBoundSource("src", fast.Name)
	clone := s.createClaimFrom("clone", slow.Name, v1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "src"})
	s.WaitUntil("the clone's PersistentVolume", func() bool { return len(s.pvsByClaim()[clone.UID]) == 1 })
	s.checkMadeFrom([]*v1.PersistentVolumeClaim{clone}, func(src *csi.VolumeContentSource) bool { return src.GetVolume().GetVolumeId() == srcHandle })
	s.WaitUntil("the cloning finalizer gone", func() bool { return !slices.Contains(s.claimFinalizers("src"), cloneFinalizer) })

	// A bound claim whose volume is another driver's.
	const other = "other.csi.sidecars.io"
	foreignClass := s.createClass("foreign", func(sc *storagev1.StorageClass) { sc.Provisioner = other })
	foreign := s.createClaimAnnotated("foreign", foreignClass.Name, "", map[string]string{"volume.kubernetes.io/storage-provisioner": other})
	pv := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: s.name("foreign")},
		Spec: v1.PersistentVolumeSpec{
			AccessModes:            []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			Capacity:               v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")},
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: other, VolumeHandle: "foreign-1"}},
			StorageClassName:       foreignClass.Name,
			ClaimRef:               &v1.ObjectReference{Namespace: s.Namespace, Name: foreign.Name, UID: foreign.UID},
		},
	}
	pv, err := s.Client.CoreV1().PersistentVolumes().Create(s.ctx(), pv, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = s.Client.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{})
	})
	if err := (e2e.Storage{Kube: s.Client, Namespace: s.Namespace, Driver: other}).Bind(s.ctx(), pv); err != nil {
		t.Fatal(err)
	}
	s.createClaimFrom("stranger", fast.Name, v1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "foreign"})
	s.WaitUntil("the refusal", func() bool {
		return slices.ContainsFunc(s.events("stranger", "ProvisioningFailed"), func(m string) bool { return strings.Contains(m, "not bound or invalid") })
	})
	if n := len(s.pvs()); n != 2 {
		t.Errorf("%d PersistentVolumes of the driver, want the source's and the clone's", n)
	}
	if slices.Contains(s.claimFinalizers("foreign"), cloneFinalizer) {
		t.Errorf("the source of a refused clone got the cloning finalizer")
	}
}

var (
	crdOnce sync.Once
	crdErr  error
)

// installSnapshotCRDs installs the VolumeSnapshot CRDs of the external-snapshotter client
// module into the test's API server, once per process, and waits until they are served.
func installSnapshotCRDs(t *testing.T, s *scenario) snapclientset.Interface {
	t.Helper()
	crdOnce.Do(func() { crdErr = applyCRDs(s) })
	if crdErr != nil {
		t.Fatalf("installing the VolumeSnapshot CRDs: %v", crdErr)
	}
	client, err := snapclientset.NewForConfig(s.CP.Config())
	if err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the VolumeSnapshot API", func() bool {
		_, err := client.SnapshotV1().VolumeSnapshots(s.Namespace).List(s.ctx(), metav1.ListOptions{})
		_, err2 := client.SnapshotV1().VolumeSnapshotContents().List(s.ctx(), metav1.ListOptions{})
		return err == nil && err2 == nil
	})
	return client
}

func applyCRDs(s *scenario) error {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/kubernetes-csi/external-snapshotter/client/v8").Output()
	if err != nil {
		return fmt.Errorf("locating the external-snapshotter client module: %w", err)
	}
	dir := filepath.Join(strings.TrimSpace(string(out)), "config", "crd")
	dyn, err := dynamic.NewForConfig(s.CP.Config())
	if err != nil {
		return err
	}
	crds := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	for _, name := range []string{"volumesnapshotclasses", "volumesnapshotcontents", "volumesnapshots"} {
		data, err := os.ReadFile(filepath.Join(dir, "snapshot.storage.k8s.io_"+name+".yaml"))
		if err != nil {
			return err
		}
		obj := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(data, &obj.Object); err != nil {
			return fmt.Errorf("parsing the %s CRD: %w", name, err)
		}
		if _, err := crds.Create(context.Background(), obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("creating the %s CRD: %w", name, err)
		}
	}
	return nil
}

// createReadySnapshot does what the snapshot controller and the external-snapshotter do
// for a VolumeSnapshot of a volume: the backend snapshot, a bound content, ready statuses.
func (s *scenario) createReadySnapshot(client snapclientset.Interface, name, volumeID string) testdriver.Snapshot {
	s.T.Helper()
	ctx := s.ctx()
	backend, err := s.Driver.TakeSnapshot(s.Namespace+"-"+name, volumeID)
	if err != nil {
		s.T.Fatal(err)
	}
	contentName := s.name(name + "-content")
	snap, err := client.SnapshotV1().VolumeSnapshots(s.Namespace).Create(ctx, &snapshotv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{VolumeSnapshotContentName: &contentName}},
	}, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	content, err := client.SnapshotV1().VolumeSnapshotContents().Create(ctx, &snapshotv1.VolumeSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{Name: contentName},
		Spec: snapshotv1.VolumeSnapshotContentSpec{
			Driver:            s.driver,
			DeletionPolicy:    snapshotv1.VolumeSnapshotContentRetain,
			Source:            snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: &backend.ID},
			VolumeSnapshotRef: v1.ObjectReference{Namespace: s.Namespace, Name: name, UID: snap.UID},
			SourceVolumeMode:  ptr.To(v1.PersistentVolumeFilesystem),
		},
	}, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	s.T.Cleanup(func() {
		_ = client.SnapshotV1().VolumeSnapshotContents().Delete(context.Background(), contentName, metav1.DeleteOptions{})
	})
	content.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &backend.ID, ReadyToUse: ptr.To(true), RestoreSize: ptr.To(backend.SizeBytes)}
	if _, err := client.SnapshotV1().VolumeSnapshotContents().UpdateStatus(ctx, content, metav1.UpdateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	snap.Status = &snapshotv1.VolumeSnapshotStatus{BoundVolumeSnapshotContentName: &contentName, ReadyToUse: ptr.To(true),
		RestoreSize: resource.NewQuantity(backend.SizeBytes, resource.BinarySI)}
	if _, err := client.SnapshotV1().VolumeSnapshots(s.Namespace).UpdateStatus(ctx, snap, metav1.UpdateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	return backend
}

func snapshotFinalizers(s *scenario, client snapclientset.Interface, name string) []string {
	snap, err := client.SnapshotV1().VolumeSnapshots(s.Namespace).Get(s.ctx(), name, metav1.GetOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return snap.Finalizers
}

// Ten claims restore one ready VolumeSnapshot: each gets a volume restored from its
// snapshot handle; the snapshot carries the source-protection finalizer while they are
// made and loses it once they all are.
func TestRestoresTenVolumesFromASnapshotAndProtectsItMeanwhile(t *testing.T) {
	s := newScenario(t, testdriver.Config{ControllerCapabilities: withCapabilities(csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)})
	snaps := installSnapshotCRDs(t, s)
	fast := s.createClass("fast", nil)
	s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	srcHandle := s.provisionBoundSource("src", fast.Name)
	backend := s.createReadySnapshot(snaps, "snap", srcHandle)

	// The restores are held in the driver until the finalizer has been seen on the snapshot.
	release := s.Driver.Hold(testdriver.MethodCreateVolume)
	t.Cleanup(release)
	start := time.Now()
	var restores []*v1.PersistentVolumeClaim
	for i := range 10 {
		restores = append(restores, s.createClaimFrom(fmt.Sprintf("restore-%02d", i), fast.Name,
			v1.TypedLocalObjectReference{APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: "snap"}))
	}
	s.WaitUntil("the source-protection finalizer on the snapshot", func() bool {
		return slices.Contains(snapshotFinalizers(s, snaps, "snap"), snapshotFinalizer)
	})
	release()
	s.waitForPVs(11)
	t.Logf("FIGURE 10 restores provisioned in %v", time.Since(start))
	s.WaitUntil("the source-protection finalizer gone", func() bool {
		return !slices.Contains(snapshotFinalizers(s, snaps, "snap"), snapshotFinalizer)
	})
	s.checkMadeFrom(restores, func(src *csi.VolumeContentSource) bool { return src.GetSnapshot().GetSnapshotId() == backend.ID })
	s.checkEveryVolumeHasExactlyOnePV()
}

// A restore that would turn a Filesystem snapshot into a Block volume is refused unless
// the content allows it (--prevent-volume-mode-conversion, on by default).
func TestARestoreThatChangesTheVolumeModeNeedsTheContentsPermission(t *testing.T) {
	s := newScenario(t, testdriver.Config{ControllerCapabilities: withCapabilities(csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)})
	snaps := installSnapshotCRDs(t, s)
	fast := s.createClass("fast", nil)
	s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	srcHandle := s.provisionBoundSource("src", fast.Name)
	s.createReadySnapshot(snaps, "snap", srcHandle)

	claim := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "block", Annotations: map[string]string{"volume.kubernetes.io/storage-provisioner": s.driver}},
		Spec: v1.PersistentVolumeClaimSpec{
			AccessModes:      []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			StorageClassName: &fast.Name,
			VolumeMode:       ptr.To(v1.PersistentVolumeBlock),
			Resources:        v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
			DataSource:       &v1.TypedLocalObjectReference{APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: "snap"},
		},
	}
	claim, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Create(s.ctx(), claim, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the refusal", func() bool {
		return slices.ContainsFunc(s.events("block", "ProvisioningFailed"), func(m string) bool { return strings.Contains(m, "modifies the mode") })
	})
	if len(s.pvsByClaim()[claim.UID]) != 0 {
		t.Fatalf("a volume mode conversion was provisioned without permission")
	}
	content, err := snaps.SnapshotV1().VolumeSnapshotContents().Get(s.ctx(), s.name("snap-content"), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	content.Annotations = map[string]string{"snapshot.storage.kubernetes.io/allow-volume-mode-change": "true"}
	if _, err := snaps.SnapshotV1().VolumeSnapshotContents().Update(s.ctx(), content, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the Block volume once the content allows it", func() bool { return len(s.pvsByClaim()[claim.UID]) == 1 })
}
