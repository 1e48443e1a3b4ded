package deploy

import (
	"context"
	"testing"

	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
)

// Bad input gets a clear Warning Event or status error and loses nothing, with the four
// sidecars running against the real API server: a claim whose provisioner Secret is missing,
// a class whose secret template names an unknown variable, a restore from a VolumeSnapshot
// that does not exist, a VolumeAttachment of a PersistentVolume that does not exist, and a
// snapshot whose class names a missing Secret. The good object created right after each
// still completes, and the objects waiting for a Secret complete once it appears.
func TestBadInputGetsAWarningAndTheNextObjectStillCompletes(t *testing.T) {
	cp := kube.Get(t)
	s := e2e.NewScenario(t, cp, binDir, controllerDriver())
	snaps := installSnapshotCRDs(t, s)
	ctx := context.Background()
	store := s.SetUpStorage(nil)
	for _, sidecar := range sidecars {
		s.Start(sidecar, []string{"csi-sidecars", sidecar}).WaitReady(t)
	}
	class := func(name string, params map[string]string) {
		t.Helper()
		sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: s.Namespace + "-" + name}, Provisioner: store.Driver,
			VolumeBindingMode: ptr.To(storagev1.VolumeBindingImmediate), Parameters: params}
		if _, err := s.Client.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	claim := func(name, className string, source *corev1.TypedObjectReference) {
		t.Helper()
		pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: s.Namespace, Annotations: map[string]string{
			"volume.kubernetes.io/storage-provisioner": store.Driver, "volume.beta.kubernetes.io/storage-provisioner": store.Driver,
		}}, Spec: corev1.PersistentVolumeClaimSpec{StorageClassName: ptr.To(className), AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}, DataSourceRef: source}}
		if source != nil {
			pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: source.APIGroup, Kind: source.Kind, Name: source.Name}
		}
		if _, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	warned := func(kind, name string) {
		t.Helper()
		s.WaitUntil("a Warning Event on "+kind+" "+name, func() bool {
			events, err := s.Client.CoreV1().Events(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: "type=Warning,involvedObject.name=" + name})
			if err != nil {
				return false
			}
			for _, e := range events.Items {
				if e.InvolvedObject.Kind == kind && e.Message != "" {
					t.Logf("%s %s: Warning %s: %s", kind, name, e.Reason, e.Message)
					return true
				}
			}
			return false
		})
	}
	provisioned := func(name string) {
		t.Helper()
		s.WaitUntil("a volume for claim "+name, func() bool {
			pvs, err := store.Provisioned(ctx)
			if err != nil {
				return false
			}
			for _, pv := range pvs {
				if pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Name == name {
					return true
				}
			}
			return false
		})
	}
	secret := func(name string) {
		t.Helper()
		if _, err := s.Client.CoreV1().Secrets(s.Namespace).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: s.Namespace},
			Data: map[string][]byte{"password": []byte("x")}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// The provisioner.
	class("missing-secret", map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "later", "csi.storage.k8s.io/provisioner-secret-namespace": s.Namespace})
	class("unknown-variable", map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "${pvc.unknown}", "csi.storage.k8s.io/provisioner-secret-namespace": s.Namespace})
	claim("waits-for-secret", s.Namespace+"-missing-secret", nil)
	claim("good-1", store.Class, nil)
	claim("bad-template", s.Namespace+"-unknown-variable", nil)
	claim("good-2", store.Class, nil)
	claim("missing-source", store.Class, &corev1.TypedObjectReference{APIGroup: ptr.To(snapv1.GroupName), Kind: "VolumeSnapshot", Name: "no-such-snapshot"})
	claim("good-3", store.Class, nil)
	for _, name := range []string{"waits-for-secret", "bad-template", "missing-source"} {
		warned("PersistentVolumeClaim", name)
	}
	for _, name := range []string{"good-1", "good-2", "good-3"} {
		provisioned(name)
	}
	secret("later")
	provisioned("waits-for-secret")

	// The attacher: a VolumeAttachment of a PersistentVolume that does not exist.
	if err := store.CreateAttachment(ctx, "no-such-pv"); err != nil {
		t.Fatal(err)
	}
	if _, err := store.BindAll(ctx); err != nil {
		t.Fatal(err)
	}
	pvs, err := store.Provisioned(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.CreateAttachment(ctx, pvs[0].Name); err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the good attachment attached and the bad one with an error", func() bool {
		list, err := s.Client.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		good, bad := false, false
		for _, va := range list.Items {
			switch *va.Spec.Source.PersistentVolumeName {
			case pvs[0].Name:
				good = va.Status.Attached
			case "no-such-pv":
				bad = va.Status.AttachError != nil && va.Status.AttachError.Message != ""
			}
		}
		return good && bad
	})

	// The snapshotter: a content whose class names a missing Secret, then a good one.
	runSnapshotJobWithMissingSecret(ctx, t, s, snaps, store, pvs[0], secret)
}

// runSnapshotJobWithMissingSecret snapshots pv through a class whose snapshotter Secret is
// missing (an error in the content's status), then through a class without secrets (ready),
// then creates the Secret: the first content becomes ready too.
func runSnapshotJobWithMissingSecret(ctx context.Context, t *testing.T, s *e2e.Scenario, snaps snapclientset.Interface, store e2e.Storage, pv corev1.PersistentVolume, secret func(string)) {
	t.Helper()
	secretParams := map[string]string{"csi.storage.k8s.io/snapshotter-secret-name": "snap-later", "csi.storage.k8s.io/snapshotter-secret-namespace": s.Namespace}
	content := func(name, class string) {
		t.Helper()
		// The snapshot-controller names the class's snapshotter secret on the content.
		var annotations map[string]string
		if class == s.Namespace+"-needs-secret" {
			annotations = snapshotterSecretOf(secretParams)
		}
		if _, err := snaps.SnapshotV1().VolumeSnapshotClasses().Get(ctx, class, metav1.GetOptions{}); err != nil {
			var params map[string]string
			if annotations != nil {
				params = secretParams
			}
			if _, err := snaps.SnapshotV1().VolumeSnapshotClasses().Create(ctx, &snapv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: class},
				Driver: store.Driver, DeletionPolicy: snapv1.VolumeSnapshotContentDelete, Parameters: params}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		c := &snapv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: s.Namespace + "-" + name, Annotations: annotations},
			Spec: snapv1.VolumeSnapshotContentSpec{Driver: store.Driver, DeletionPolicy: snapv1.VolumeSnapshotContentDelete,
				Source: snapv1.VolumeSnapshotContentSource{VolumeHandle: &pv.Spec.CSI.VolumeHandle}, VolumeSnapshotClassName: &class,
				VolumeSnapshotRef: corev1.ObjectReference{Kind: "VolumeSnapshot", Namespace: s.Namespace, Name: name, UID: types.UID("uid-" + name)}}}
		if _, err := snaps.SnapshotV1().VolumeSnapshotContents().Create(ctx, c, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	state := func(name string) (ready bool, failed string) {
		c, err := snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, s.Namespace+"-"+name, metav1.GetOptions{})
		if err != nil || c.Status == nil {
			return false, ""
		}
		if c.Status.Error != nil && c.Status.Error.Message != nil {
			failed = *c.Status.Error.Message
		}
		return c.Status.ReadyToUse != nil && *c.Status.ReadyToUse, failed
	}
	content("snap-waits", s.Namespace+"-needs-secret")
	content("snap-good", s.Namespace+"-plain")
	s.WaitUntil("the good snapshot ready and the one missing its Secret with an error", func() bool {
		good, _ := state("snap-good")
		_, failed := state("snap-waits")
		return good && failed != ""
	})
	_, failed := state("snap-waits")
	t.Logf("VolumeSnapshotContent snap-waits: %s", failed)
	secret("snap-later")
	s.WaitUntil("the snapshot that waited for its Secret ready", func() bool { ready, _ := state("snap-waits"); return ready })
}
