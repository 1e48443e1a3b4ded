package snapshotcontroller

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
)

var kube controlplane.Shared

func TestMain(m *testing.M) { os.Exit(kube.Main(m, controlplane.Options{})) }

// The finalizers the snapshot-controller puts on what it protects.
const (
	pvcFinalizer            = "snapshot.storage.kubernetes.io/pvc-as-source-protection"
	contentBoundFinalizer   = "snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection"
	snapshotBoundFinalizer  = "snapshot.storage.kubernetes.io/volumesnapshot-bound-protection"
	snapshotSourceFinalizer = "snapshot.storage.kubernetes.io/volumesnapshot-as-source-protection"
)

func TestAssetsNamesTheMissingBinaryAndHowToBuildIt(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(controlplane.AssetsEnv, dir)
	for _, bin := range []string{"etcd", "kube-apiserver"} {
		if err := os.WriteFile(filepath.Join(dir, bin), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_, err := Assets()
	if err == nil {
		t.Fatal("Assets() succeeded without snapshot-controller")
	}
	for _, want := range []string{"make testenv", filepath.Join(dir, Binary) + " is missing", Version} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Assets() error %q does not mention %q", err, want)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, Binary), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got, err := Assets(); err != nil || got != dir {
		t.Errorf("Assets() = %q, %v; want %q", got, err, dir)
	}
}

// The embedded CRDs are the files of the client module version go.mod requires, so a bump
// of the module without copying them again fails here.
func TestEmbeddedCRDsAreTheModulesFiles(t *testing.T) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Version}} {{.Dir}}", "github.com/kubernetes-csi/external-snapshotter/client/v8").Output()
	if err != nil {
		t.Skipf("go list of the client module: %v", err)
	}
	version, dir, _ := strings.Cut(strings.TrimSpace(string(out)), " ")
	if version != CRDVersion {
		t.Fatalf("go.mod requires client/v8 %s, the embedded CRDs are of %s: copy them again (crd/README.md)", version, CRDVersion)
	}
	if dir == "" {
		t.Skip("client module not downloaded")
	}
	for _, name := range CRDFiles {
		want, err := os.ReadFile(filepath.Join(dir, "config", "crd", name))
		if err != nil {
			t.Fatal(err)
		}
		got, err := crdFS.ReadFile(path.Join("crd", name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("crd/%s differs from the module's %s", name, CRDVersion)
		}
	}
	crds, err := CRDs()
	if err != nil {
		t.Fatal(err)
	}
	if len(crds) != 6 {
		t.Fatalf("CRDs() = %d objects, want 6", len(crds))
	}
}

// The real snapshot-controller, against CRDs installed by InstallCRDs: it binds a
// pre-provisioned content to its snapshot, and for a dynamic snapshot of a bound claim it
// creates the content a csi-snapshotter acts on, then reports the snapshot ready once the
// content is (the status a csi-snapshotter would write is written here by the test).
func TestSnapshotControllerBindsAndCreatesContents(t *testing.T) {
	cp := kube.Get(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	assets, err := Assets()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(filepath.Join(assets, Binary), "--version").Output()
	if err != nil || !strings.Contains(string(out), Version) {
		t.Fatalf("%s --version = %q, %v; want %s", Binary, out, err, Version)
	}

	// Twice, as tests sharing a control plane would: the second is a no-op.
	for range 2 {
		if err := InstallCRDs(ctx, cp.Config()); err != nil {
			t.Fatal(err)
		}
	}
	ctrl, err := Start(ctx, cp, Options{SkipCRDs: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(ctrl.Diagnostics())
		}
		if err := ctrl.Stop(); err != nil {
			t.Error(err)
		}
	})
	log, err := os.ReadFile(ctrl.Child().LogPath())
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(log, []byte("VolumeGroupSnapshot CRDs were not found")) {
		t.Errorf("the snapshot-controller runs without group snapshots: it did not find their CRDs")
	}

	core := kubernetes.NewForConfigOrDie(cp.Config())
	snaps := snapclientset.NewForConfigOrDie(cp.Config())
	const driver = "x"
	// A fresh namespace, whose name also prefixes the cluster-wide objects, so -count=N
	// and other tests on this control plane never collide.
	namespace, err := core.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "snapctl-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ns := namespace.Name
	class, err := snaps.SnapshotV1().VolumeSnapshotClasses().Create(ctx, &snapshotv1.VolumeSnapshotClass{
		ObjectMeta:     metav1.ObjectMeta{Name: ns + "-class"},
		Driver:         driver,
		DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete,
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	t.Run("pre-provisioned", func(t *testing.T) {
		contentName := ns + "-static"
		content, err := snaps.SnapshotV1().VolumeSnapshotContents().Create(ctx, &snapshotv1.VolumeSnapshotContent{
			ObjectMeta: metav1.ObjectMeta{Name: contentName},
			Spec: snapshotv1.VolumeSnapshotContentSpec{
				Driver:                  driver,
				DeletionPolicy:          snapshotv1.VolumeSnapshotContentRetain,
				Source:                  snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: ptr.To("snap-handle-1")},
				VolumeSnapshotClassName: &class.Name,
				VolumeSnapshotRef:       corev1.ObjectReference{Namespace: ns, Name: "static"},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		content.Status = &snapshotv1.VolumeSnapshotContentStatus{
			SnapshotHandle: ptr.To("snap-handle-1"),
			ReadyToUse:     ptr.To(true),
			RestoreSize:    ptr.To[int64](1 << 30),
			CreationTime:   ptr.To(time.Now().UnixNano()),
		}
		if _, err := snaps.SnapshotV1().VolumeSnapshotContents().UpdateStatus(ctx, content, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		snap, err := snaps.SnapshotV1().VolumeSnapshots(ns).Create(ctx, &snapshotv1.VolumeSnapshot{
			ObjectMeta: metav1.ObjectMeta{Name: "static"},
			Spec:       snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{VolumeSnapshotContentName: &contentName}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}

		snap = waitFor(ctx, t, ctrl, "the snapshot bound to its content and ready",
			func(ctx context.Context) (*snapshotv1.VolumeSnapshot, error) {
				return snaps.SnapshotV1().VolumeSnapshots(ns).Get(ctx, "static", metav1.GetOptions{})
			},
			func(s *snapshotv1.VolumeSnapshot) bool {
				return s.Status != nil && ptr.Deref(s.Status.BoundVolumeSnapshotContentName, "") == contentName &&
					ptr.Deref(s.Status.ReadyToUse, false) && slices.Contains(s.Finalizers, snapshotSourceFinalizer)
			})
		if got := snap.Status.RestoreSize; got == nil || got.Value() != 1<<30 {
			t.Errorf("snapshot status.restoreSize = %v, want the content's 1Gi", got)
		}
		if snap.Status.CreationTime == nil {
			t.Errorf("snapshot status.creationTime not copied from the content")
		}
		waitFor(ctx, t, ctrl, "the content bound to the snapshot's UID, with its finalizer",
			func(ctx context.Context) (*snapshotv1.VolumeSnapshotContent, error) {
				return snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, contentName, metav1.GetOptions{})
			},
			func(c *snapshotv1.VolumeSnapshotContent) bool {
				return c.Spec.VolumeSnapshotRef.UID == snap.UID && slices.Contains(c.Finalizers, contentBoundFinalizer)
			})
	})

	t.Run("dynamic", func(t *testing.T) {
		// A claim bound to a CSI volume of the driver, as kube-controller-manager and a
		// provisioner would leave it (there is no kube-controller-manager here, so nothing
		// else writes these statuses).
		claim, err := core.CoreV1().PersistentVolumeClaims(ns).Create(ctx, &corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "claim"},
			Spec: corev1.PersistentVolumeClaimSpec{
				AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
				StorageClassName: ptr.To(""),
				VolumeName:       ns + "-pv",
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		pv, err := core.CoreV1().PersistentVolumes().Create(ctx, &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: ns + "-pv"},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
				VolumeMode:                    ptr.To(corev1.PersistentVolumeFilesystem),
				ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: ns, Name: claim.Name, UID: claim.UID},
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
					Driver: driver, VolumeHandle: "vol-1",
				}},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		pv.Status.Phase = corev1.VolumeBound
		if _, err := core.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		claim.Status = corev1.PersistentVolumeClaimStatus{
			Phase:       corev1.ClaimBound,
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
		}
		if _, err := core.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}

		snap, err := snaps.SnapshotV1().VolumeSnapshots(ns).Create(ctx, &snapshotv1.VolumeSnapshot{
			ObjectMeta: metav1.ObjectMeta{Name: "dynamic"},
			Spec: snapshotv1.VolumeSnapshotSpec{
				Source:                  snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &claim.Name},
				VolumeSnapshotClassName: &class.Name,
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		contentName := "snapcontent-" + string(snap.UID)
		content := waitFor(ctx, t, ctrl, "the content the controller creates for the snapshot",
			func(ctx context.Context) (*snapshotv1.VolumeSnapshotContent, error) {
				return snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, contentName, metav1.GetOptions{})
			},
			func(*snapshotv1.VolumeSnapshotContent) bool { return true })
		spec := content.Spec
		if ptr.Deref(spec.Source.VolumeHandle, "") != "vol-1" || spec.Source.SnapshotHandle != nil {
			t.Errorf("content spec.source = %s, want volumeHandle vol-1 only", toJSON(spec.Source))
		}
		if spec.Driver != driver || spec.DeletionPolicy != class.DeletionPolicy || ptr.Deref(spec.VolumeSnapshotClassName, "") != class.Name {
			t.Errorf("content driver, deletionPolicy, class = %q, %q, %v; want %q, %q, %q",
				spec.Driver, spec.DeletionPolicy, ptr.Deref(spec.VolumeSnapshotClassName, "<nil>"), driver, class.DeletionPolicy, class.Name)
		}
		if ref := spec.VolumeSnapshotRef; ref.Namespace != ns || ref.Name != snap.Name || ref.UID != snap.UID {
			t.Errorf("content spec.volumeSnapshotRef = %s, want %s/%s uid %s", toJSON(ref), ns, snap.Name, snap.UID)
		}
		if ptr.Deref(spec.SourceVolumeMode, "") != corev1.PersistentVolumeFilesystem {
			t.Errorf("content spec.sourceVolumeMode = %v, want the volume's Filesystem", spec.SourceVolumeMode)
		}
		if content.Status != nil && content.Status.SnapshotHandle != nil {
			t.Errorf("content has a snapshot handle, yet no csi-snapshotter runs: %s", toJSON(content.Status))
		}

		waitFor(ctx, t, ctrl, "the snapshot bound to the content, not ready",
			func(ctx context.Context) (*snapshotv1.VolumeSnapshot, error) {
				return snaps.SnapshotV1().VolumeSnapshots(ns).Get(ctx, snap.Name, metav1.GetOptions{})
			},
			func(s *snapshotv1.VolumeSnapshot) bool {
				return s.Status != nil && ptr.Deref(s.Status.BoundVolumeSnapshotContentName, "") == contentName &&
					!ptr.Deref(s.Status.ReadyToUse, false)
			})
		waitFor(ctx, t, ctrl, "the claim protected while it is the source of a snapshot being cut",
			func(ctx context.Context) (*corev1.PersistentVolumeClaim, error) {
				return core.CoreV1().PersistentVolumeClaims(ns).Get(ctx, claim.Name, metav1.GetOptions{})
			},
			func(c *corev1.PersistentVolumeClaim) bool { return slices.Contains(c.Finalizers, pvcFinalizer) })

		waitFor(ctx, t, ctrl, "the content with its finalizer",
			func(ctx context.Context) (*snapshotv1.VolumeSnapshotContent, error) {
				return snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, contentName, metav1.GetOptions{})
			},
			func(c *snapshotv1.VolumeSnapshotContent) bool {
				return slices.Contains(c.Finalizers, contentBoundFinalizer)
			})
		// What the csi-snapshotter writes once the driver cut the snapshot.
		err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
			content, err := snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, contentName, metav1.GetOptions{})
			if err != nil {
				return err
			}
			content.Status = &snapshotv1.VolumeSnapshotContentStatus{
				SnapshotHandle: ptr.To("snap-of-vol-1"),
				ReadyToUse:     ptr.To(true),
				RestoreSize:    ptr.To[int64](1 << 30),
				CreationTime:   ptr.To(time.Now().UnixNano()),
			}
			_, err = snaps.SnapshotV1().VolumeSnapshotContents().UpdateStatus(ctx, content, metav1.UpdateOptions{})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		// The content's deletionPolicy (the class's) is Delete, so the snapshot gets the
		// bound finalizer too (a Retain content, as the pre-provisioned one, does not).
		waitFor(ctx, t, ctrl, "the snapshot ready, with its finalizers",
			func(ctx context.Context) (*snapshotv1.VolumeSnapshot, error) {
				return snaps.SnapshotV1().VolumeSnapshots(ns).Get(ctx, snap.Name, metav1.GetOptions{})
			},
			func(s *snapshotv1.VolumeSnapshot) bool {
				return s.Status != nil && ptr.Deref(s.Status.ReadyToUse, false) && s.Status.RestoreSize != nil &&
					slices.Contains(s.Finalizers, snapshotSourceFinalizer) && slices.Contains(s.Finalizers, snapshotBoundFinalizer)
			})
		waitFor(ctx, t, ctrl, "the claim's protection released",
			func(ctx context.Context) (*corev1.PersistentVolumeClaim, error) {
				return core.CoreV1().PersistentVolumeClaims(ns).Get(ctx, claim.Name, metav1.GetOptions{})
			},
			func(c *corev1.PersistentVolumeClaim) bool { return !slices.Contains(c.Finalizers, pvcFinalizer) })
	})

	if err := ctrl.Running(); err != nil {
		t.Error(err)
	}
}

// waitFor polls get until ok holds and returns that object. It fails t with the last object
// seen (or error) when ctx or a minute runs out, and at once when the controller exits.
func waitFor[T any](ctx context.Context, t *testing.T, c *Controller, what string, get func(context.Context) (T, error), ok func(T) bool) T {
	t.Helper()
	var last T
	var lastErr error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := c.Running(); err != nil {
			return false, err
		}
		obj, err := get(ctx)
		if err != nil {
			lastErr = err
			return false, nil
		}
		last, lastErr = obj, nil
		return ok(obj), nil
	})
	if err != nil {
		t.Fatalf("waiting for %s: %v\nlast error: %v\nlast seen: %s", what, err, lastErr, toJSON(last))
	}
	return last
}

func toJSON(v any) string {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err.Error()
	}
	return string(b)
}
