package memory

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/snapshotcontroller"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// snapshotCaps is the test driver's default capabilities and the snapshot ones a
// snapshotter needs (upstream's exits without them; ours refuses to start).
func snapshotCaps() []csi.ControllerServiceCapability_RPC_Type {
	return append(testdriver.DefaultControllerCapabilities(),
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT, csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS)
}

// snapshotDriver is a test driver that takes and lists snapshots.
func snapshotDriver() testdriver.Config {
	return testdriver.Config{ControllerCapabilities: snapshotCaps()}
}

// snapshotClasses are the data set's VolumeSnapshotClasses of the driver (the name is the
// namespace's plus the suffix): a default one, one that keeps its snapshots and one with
// the snapshotter secret, as a cluster with a few backup schedules has.
var snapshotClasses = []struct {
	suffix string
	policy snapv1.DeletionPolicy
	dflt   bool
	params map[string]string
}{
	{"daily", snapv1.VolumeSnapshotContentDelete, true, map[string]string{"tier": "standard", "incremental": "true"}},
	{"weekly-retain", snapv1.VolumeSnapshotContentRetain, false, map[string]string{"tier": "archive"}},
	{"secret", snapv1.VolumeSnapshotContentDelete, false, map[string]string{"tier": "standard",
		"csi.storage.k8s.io/snapshotter-secret-name":      "snapshot-creds",
		"csi.storage.k8s.io/snapshotter-secret-namespace": "${volumesnapshot.namespace}"}},
}

// snapshotData is the steady state of a cluster that snapshots the data set's claims:
// VolumeSnapshotClasses of the driver and ready dynamic VolumeSnapshotContents, as the
// snapshot-controller created them and the snapshotter left them once the driver cut the
// snapshot (status ready with the snapshot's handle, size and time). A snapshotter started on
// it caches every content and every class and has nothing to do: it makes no call to the
// driver for a ready content and writes nothing. The VolumeSnapshots themselves, which only
// the snapshot-controller watches, are not created. Each content carries one label, the
// run's (for the clean-up), as backup tools label theirs (Velero: velero.io/backup-name);
// a third carry the deletion secret's annotations of their class.
type snapshotData struct {
	d        *dataset
	snaps    snapclientset.Interface
	classes  []string
	contents int // created so far: content i snapshots claim i mod d.pairs
}

// newSnapshotData installs the snapshot CRDs (v8.7.0, idempotent) and creates the classes.
// d must hold at least one claim before contents are made.
func newSnapshotData(ctx context.Context, d *dataset) (*snapshotData, error) {
	admin := d.s.CP.Config()
	if err := snapshotcontroller.InstallCRDs(ctx, admin); err != nil {
		return nil, err
	}
	cfg := d.s.CP.Config() // custom resources speak JSON, not protobuf
	cfg.QPS, cfg.Burst = setupQPS, setupBurst
	snaps, err := snapclientset.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	sd := &snapshotData{d: d, snaps: snaps}
	d.s.T.Cleanup(sd.cleanUp)
	for _, c := range snapshotClasses {
		class := &snapv1.VolumeSnapshotClass{
			ObjectMeta:     metav1.ObjectMeta{Name: d.s.Namespace + "-" + c.suffix, Labels: map[string]string{runLabel: d.s.Namespace}},
			Driver:         d.driver,
			DeletionPolicy: c.policy,
			Parameters:     c.params,
		}
		if c.dflt {
			class.Annotations = map[string]string{"snapshot.storage.kubernetes.io/is-default-class": "true"}
		}
		if _, err := snaps.SnapshotV1().VolumeSnapshotClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
			return nil, fmt.Errorf("creating VolumeSnapshotClass: %w", err)
		}
		sd.classes = append(sd.classes, class.Name)
	}
	return sd, nil
}

// grow creates contents sd.contents..to-1, concurrently: each snapshot is cut in the
// driver's backend (as the snapshotter's CreateSnapshot left it), then its content is
// created and its status written ready.
func (sd *snapshotData) grow(ctx context.Context, to int) error {
	if sd.d.pairs == 0 {
		return fmt.Errorf("snapshots of a data set without claims")
	}
	if err := inParallel(ctx, sd.contents, to, "snapshot", sd.content); err != nil {
		return err
	}
	sd.contents = to
	return nil
}

// content creates snapshot i of claim i mod pairs: the snapshot in the driver and its ready
// VolumeSnapshotContent, named and filled as the snapshot-controller names and fills a
// dynamic snapshot's content (snapcontent-<VolumeSnapshot UID>, the bound-protection
// finalizer, the class's deletion policy).
func (sd *snapshotData) content(ctx context.Context, i int) error {
	d := sd.d
	ns := d.s.Namespace
	claim := i % d.pairs
	class := snapshotClasses[i%len(snapshotClasses)]
	uid := types.UID(uuid.NewUUID())
	snap, err := d.s.Driver.TakeSnapshot("snapshot-"+string(uid), d.handles[claim])
	if err != nil {
		return fmt.Errorf("cutting the snapshot: %w", err)
	}
	handle := d.handles[claim]
	content := &snapv1.VolumeSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{
			Name:       "snapcontent-" + string(uid),
			Labels:     map[string]string{runLabel: ns},
			Finalizers: []string{"snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection"},
		},
		Spec: snapv1.VolumeSnapshotContentSpec{
			VolumeSnapshotRef: corev1.ObjectReference{Kind: "VolumeSnapshot", APIVersion: "snapshot.storage.k8s.io/v1",
				Namespace: ns, Name: fmt.Sprintf("data-app-%05d-%s-%d", claim, class.suffix, i/d.pairs), UID: uid,
				ResourceVersion: fmt.Sprint(100000 + i)},
			DeletionPolicy:          class.policy,
			Driver:                  d.driver,
			VolumeSnapshotClassName: ptr.To(ns + "-" + class.suffix),
			Source:                  snapv1.VolumeSnapshotContentSource{VolumeHandle: &handle},
			SourceVolumeMode:        ptr.To(corev1.PersistentVolumeFilesystem),
		},
	}
	if class.params["csi.storage.k8s.io/snapshotter-secret-name"] != "" {
		// The snapshot-controller records the resolved secret for the deletion.
		content.Annotations = map[string]string{
			"snapshot.storage.kubernetes.io/deletion-secret-name":      "snapshot-creds",
			"snapshot.storage.kubernetes.io/deletion-secret-namespace": ns,
		}
	}
	content, err = sd.snaps.SnapshotV1().VolumeSnapshotContents().Create(ctx, content, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("creating VolumeSnapshotContent: %w", err)
	}
	content.Status = &snapv1.VolumeSnapshotContentStatus{
		SnapshotHandle: ptr.To(snap.ID),
		CreationTime:   ptr.To(snap.CreationTime.UnixNano()),
		RestoreSize:    ptr.To(snap.SizeBytes),
		ReadyToUse:     ptr.To(true),
	}
	if _, err := sd.snaps.SnapshotV1().VolumeSnapshotContents().UpdateStatus(ctx, content, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("VolumeSnapshotContent status: %w", err)
	}
	return nil
}

// versions maps each content of the data set to its resourceVersion.
func (sd *snapshotData) versions(ctx context.Context) (map[string]string, error) {
	list, err := sd.snaps.SnapshotV1().VolumeSnapshotContents().List(ctx, metav1.ListOptions{LabelSelector: runLabel + "=" + sd.d.s.Namespace})
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, c := range list.Items {
		out[c.Name] = c.ResourceVersion
	}
	return out, nil
}

// written counts the contents of before whose resourceVersion changed or that are gone.
func (sd *snapshotData) written(ctx context.Context, before map[string]string) (int, error) {
	after, err := sd.versions(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for name, rv := range before {
		if after[name] != rv {
			n++
		}
	}
	return n, nil
}

// contentJSONSize is the size of one content as JSON, as the API server serves it.
func (sd *snapshotData) contentJSONSize(ctx context.Context) (int, error) {
	list, err := sd.snaps.SnapshotV1().VolumeSnapshotContents().List(ctx, metav1.ListOptions{Limit: 1, LabelSelector: runLabel + "=" + sd.d.s.Namespace})
	if err != nil || len(list.Items) == 0 {
		return 0, err
	}
	raw, err := json.Marshal(list.Items[0])
	return len(raw), err
}

// cleanUp removes the contents (their finalizer first) and the classes; registered after
// the claims' clean-up, it runs before it. The driver's snapshots go with the driver.
func (sd *snapshotData) cleanUp() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns := sd.d.s.Namespace
	sel := metav1.ListOptions{LabelSelector: runLabel + "=" + ns}
	noFinalizers := []byte(`{"metadata":{"finalizers":null}}`)
	var failed atomic.Int64
	list, err := sd.snaps.SnapshotV1().VolumeSnapshotContents().List(ctx, sel)
	if err != nil {
		failed.Add(1)
	} else {
		work := make(chan string)
		var wg sync.WaitGroup
		for range setupWorkers {
			wg.Go(func() {
				for name := range work {
					contents := sd.snaps.SnapshotV1().VolumeSnapshotContents()
					if _, err := contents.Patch(ctx, name, types.MergePatchType, noFinalizers, metav1.PatchOptions{}); err != nil && !apierrors.IsNotFound(err) {
						failed.Add(1)
						continue
					}
					if err := contents.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
						failed.Add(1)
					}
				}
			})
		}
		for _, c := range list.Items {
			work <- c.Name
		}
		close(work)
		wg.Wait()
	}
	if err := sd.snaps.SnapshotV1().VolumeSnapshotClasses().DeleteCollection(ctx, metav1.DeleteOptions{}, sel); err != nil {
		failed.Add(1)
	}
	if n := failed.Load(); n > 0 {
		sd.d.s.T.Logf("snapshot clean-up: %d requests failed; later runs on this control plane see leftovers", n)
	}
}
