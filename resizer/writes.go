package resizer

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Annotations and event reasons, as upstream spells them (P9).
const (
	// annResizer names the resizer of an in-tree or migrated PVC.
	annResizer = "volume.kubernetes.io/storage-resizer"
	// annPreResizeCapacity is put on the PV with its capacity before a resize that needs
	// node expansion (AnnotateFsResize), and removed once the node caught up.
	annPreResizeCapacity = "volume.alpha.kubernetes.io/pre-resize-capacity"
	// annNodeExpansionNotRequired tells the kubelet that the resize finished in the controller.
	annNodeExpansionNotRequired = "volume.kubernetes.io/node-expansion-not-required"

	reasonResizing         = "Resizing"
	reasonResizeFailed     = "VolumeResizeFailed"
	reasonResizeSucceeded  = "VolumeResizeSuccessful"
	reasonFSResizeRequired = "FileSystemResizeRequired"
	reasonModify           = "VolumeModify"
	reasonModifyFailed     = "VolumeModifyFailed"
	reasonModifySucceeded  = "VolumeModifySuccessful"
	reasonModifyCancelled  = "VolumeModifyCanceled"
)

// writer is what both controllers share to act on the API server: every write of an
// operation runs on a context derived from ops (the core's Ops(), P1).
type writer struct {
	kube     kubernetes.Interface
	ops      func() context.Context
	timeout  time.Duration // of each CSI call
	recorder record.EventRecorder
	driver   string
	// claims and volumes are the PVC and PV informer caches read through this sidecar's
	// own writes (lifecycle.OwnWrites): a sync that follows a write of ours before its
	// watch event arrived starts from what we wrote.
	claims  *lifecycle.OwnWrites[*v1.PersistentVolumeClaim]
	volumes *lifecycle.OwnWrites[*v1.PersistentVolume]
	// intake is the controller's run's, set before its workers start; nil in tests that
	// sync without run.
	intake context.Context
}

// controllerConfig is what the expansion and the modify controller are both built from,
// besides their own parts: the writer (with the controller's call timeout), the queue's
// name and settings, and the informers.
type controllerConfig struct {
	writer
	queueName    string
	queueMetrics workqueue.MetricsProvider // nil: client-go's process-wide provider
	backlog      *lifecycle.Backlog
	informers    informers.SharedInformerFactory
	resync       time.Duration
	retryStart   time.Duration
	retryMax     time.Duration
}

// forController is cfg for one controller: its writer and its queue's name.
func (cfg controllerConfig) forController(w writer, queueName string) controllerConfig {
	cfg.writer, cfg.queueName = w, queueName
	return cfg
}

// newQueue is the controller's queue, with upstream's retry backoff.
func (cfg controllerConfig) newQueue() *lifecycle.Queue[string] {
	return lifecycle.NewQueue[string](lifecycle.QueueOptions{Name: cfg.queueName, RetryStart: cfg.retryStart, RetryMax: cfg.retryMax,
		Metrics: cfg.queueMetrics, Backlog: cfg.backlog})
}

// newWriter builds the writer both controllers share, reading PVCs and PVs from factory.
func newWriter(kube kubernetes.Interface, ops func() context.Context, recorder record.EventRecorder, driver string, factory informers.SharedInformerFactory) (writer, error) {
	logger := klog.FromContext(ops())
	claims, err := lifecycle.NewOwnWrites[*v1.PersistentVolumeClaim](logger, factory.Core().V1().PersistentVolumeClaims().Informer())
	if err != nil {
		return writer{}, fmt.Errorf("PVC cache: %w", err)
	}
	volumes, err := lifecycle.NewOwnWrites[*v1.PersistentVolume](logger, factory.Core().V1().PersistentVolumes().Informer())
	if err != nil {
		return writer{}, fmt.Errorf("PV cache: %w", err)
	}
	return writer{kube: kube, ops: ops, recorder: recorder, driver: driver, claims: claims, volumes: volumes}, nil
}

// withCallTimeout is w for a controller whose CSI calls each take at most timeout.
func (w writer) withCallTimeout(timeout time.Duration) writer {
	w.timeout = timeout
	return w
}

// claim is the PVC ns/name as the informer or our last write of it knows it, the newer.
func (w *writer) claim(ns, name string) (*v1.PersistentVolumeClaim, bool, error) {
	return w.claims.Get(ns + "/" + name)
}

// volume is the PV name as the informer or our last write of it knows it, the newer.
func (w *writer) volume(name string) (*v1.PersistentVolume, bool, error) {
	return w.volumes.Get(name)
}

// callContext bounds one CSI call by the controller's timeout (--resize-timeout or
// --modify-timeout, or --timeout when set), on Ops() (P1). API writes run on Ops()
// itself: a write waits for its token of the client budget as long as it takes, and
// client-go bounds the request once sent (P14).
func (w *writer) callContext() (context.Context, context.CancelFunc) {
	return context.WithTimeout(w.ops(), w.timeout)
}

// patchClaim writes the difference between old and updated through the PVC's status
// subresource, which also takes metadata (annotations) and leaves spec alone. With
// checkVersion the patch carries old's resourceVersion, so a concurrent change fails it
// with a conflict instead of being overwritten. When there is no difference nothing is sent
// and old is returned: retries of a step already recorded cost no write.
func (w *writer) patchClaim(old, updated *v1.PersistentVolumeClaim, checkVersion bool) (*v1.PersistentVolumeClaim, error) {
	return w.patchClaimOn(w.ops(), old, updated, checkVersion)
}

// startClaim is patchClaim for the write that starts an operation (marking it in
// progress, before the driver is called): it ends with intake and waits behind the writes
// that finish work (P14); cut short by intake's end, its error is NotStarted.
func (w *writer) startClaim(old, updated *v1.PersistentVolumeClaim) (*v1.PersistentVolumeClaim, error) {
	intake := w.intake
	if intake == nil {
		intake = context.Background()
	}
	ctx, cancel := lifecycle.StartingWork(w.ops(), intake)
	defer cancel()
	out, err := w.patchClaimOn(ctx, old, updated, true)
	return out, lifecycle.IfNotStarted(ctx, err)
}

func (w *writer) patchClaimOn(ctx context.Context, old, updated *v1.PersistentVolumeClaim, checkVersion bool) (*v1.PersistentVolumeClaim, error) {
	patch, err := twoWayPatch(old, updated, &v1.PersistentVolumeClaim{}, checkVersion, old.ResourceVersion)
	if err != nil || patch == nil {
		return old, err
	}
	out, err := w.kube.CoreV1().PersistentVolumeClaims(old.Namespace).Patch(ctx, old.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil {
		return old, fmt.Errorf("patching PVC %s/%s: %w", old.Namespace, old.Name, err)
	}
	w.claims.Wrote(out)
	return out, nil
}

// patchVolume writes the difference between old and updated to the PV, if any.
func (w *writer) patchVolume(old, updated *v1.PersistentVolume) (*v1.PersistentVolume, error) {
	patch, err := twoWayPatch(old, updated, &v1.PersistentVolume{}, false, "")
	if err != nil || patch == nil {
		return old, err
	}
	ctx := w.ops()
	out, err := w.kube.CoreV1().PersistentVolumes().Patch(ctx, old.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return old, fmt.Errorf("patching PV %s: %w", old.Name, err)
	}
	w.volumes.Wrote(out)
	return out, nil
}

// twoWayPatch is the strategic merge patch from old to updated, nil when they are equal.
func twoWayPatch(old, updated, schema any, checkVersion bool, resourceVersion string) ([]byte, error) {
	oldJSON, err := json.Marshal(old)
	if err != nil {
		return nil, fmt.Errorf("encoding the current object: %w", err)
	}
	newJSON, err := json.Marshal(updated)
	if err != nil {
		return nil, fmt.Errorf("encoding the updated object: %w", err)
	}
	patch, err := strategicpatch.CreateTwoWayMergePatch(oldJSON, newJSON, schema)
	if err != nil {
		return nil, fmt.Errorf("computing the patch: %w", err)
	}
	if string(patch) == "{}" {
		return nil, nil
	}
	if !checkVersion {
		return patch, nil
	}
	var m map[string]any
	if err := json.Unmarshal(patch, &m); err != nil {
		return nil, fmt.Errorf("decoding the patch: %w", err)
	}
	meta, _ := m["metadata"].(map[string]any)
	if meta == nil {
		meta = map[string]any{}
		m["metadata"] = meta
	}
	meta["resourceVersion"] = resourceVersion
	return json.Marshal(m)
}

// setCondition returns conds with c in place of any condition of its type. An existing
// condition with the same status and message is kept as it is, lastTransitionTime included,
// so repeating a step changes nothing (and writes nothing).
func setCondition(conds []v1.PersistentVolumeClaimCondition, c v1.PersistentVolumeClaimCondition) []v1.PersistentVolumeClaimCondition {
	out := make([]v1.PersistentVolumeClaimCondition, 0, len(conds)+1)
	found := false
	for _, old := range conds {
		if old.Type != c.Type {
			out = append(out, old)
			continue
		}
		found = true
		if old.Status == c.Status && old.Message == c.Message && old.Reason == c.Reason {
			out = append(out, old)
		} else {
			out = append(out, c)
		}
	}
	if !found {
		out = append(out, c)
	}
	return out
}

// dropConditions returns conds without the conditions whose type drop says to remove.
func dropConditions(conds []v1.PersistentVolumeClaimCondition, drop func(v1.PersistentVolumeClaimConditionType) bool) []v1.PersistentVolumeClaimCondition {
	var out []v1.PersistentVolumeClaimCondition
	for _, c := range conds {
		if !drop(c.Type) {
			out = append(out, c)
		}
	}
	return out
}

// newCondition is a true condition of type t, changed now.
func newCondition(t v1.PersistentVolumeClaimConditionType, message string) v1.PersistentVolumeClaimCondition {
	return v1.PersistentVolumeClaimCondition{Type: t, Status: v1.ConditionTrue, LastTransitionTime: metav1.Now(), Message: message}
}

// claimKey is the queue key of a PVC (namespace/name), also from a deletion tombstone.
func claimKey(obj any) (string, bool) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	return key, err == nil
}

// resync enqueues a PVC that a periodic resync delivered, unless a failure's rate-limited
// retry of it is pending: a resync retries what is due, it must not cut a backoff short
// (the queue's backoff, not the resync period, paces a failing driver).
func resync(queue workqueue.TypedRateLimitingInterface[string], obj any) {
	if key, ok := claimKey(obj); ok && queue.NumRequeues(key) == 0 {
		queue.Add(key)
	}
}

// ofDriver tells whether pv is a CSI volume of driver.
func ofDriver(pv *v1.PersistentVolume, driver string) bool {
	return pv.Spec.CSI != nil && pv.Spec.CSI.Driver == driver
}

// boundTo tells whether pv is bound to pvc (namespace and UID), as the PV controller binds.
func boundTo(pv *v1.PersistentVolume, pvc *v1.PersistentVolumeClaim) bool {
	ref := pv.Spec.ClaimRef
	return ref != nil && ref.Namespace == pvc.Namespace && ref.UID == pvc.UID
}
