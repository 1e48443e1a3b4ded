// A released PersistentVolume's way: DeleteVolume, then the PersistentVolume and its
// finalizer, each step at most once per process.

package deletion

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	storagev1informers "k8s.io/client-go/informers/storage/v1"
	"k8s.io/client-go/kubernetes"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// Deleter keeps the finalizer of the driver's PersistentVolumes right and deletes
// the released ones: DeleteVolume, then the PersistentVolume, then its finalizer. It owns
// the volume queue (keyed by PersistentVolume name); the claim's way never reaches it.
type Deleter struct {
	cfg   Config
	queue *lifecycle.Queue[string]
	// volumes is the PersistentVolume cache through this process's writes: a PersistentVolume
	// it let go is missing (Gone), and a DeleteVolume that succeeded is remembered as a step
	// taken (stepDeleteVolume), until the informer shows the PersistentVolume deleted.
	volumes *lifecycle.OwnWrites[*v1.PersistentVolume]
	classes storagelisters.StorageClassLister
	// attachments is nil unless the driver publishes: then deletion waits for the volume to
	// be detached everywhere.
	attachments storagelisters.VolumeAttachmentLister
}

// Config is what the deleter needs from the provisioner. Every func but Holds is required.
type Config struct {
	// Names are the names the driver's PersistentVolumes may give it.
	Names request.DriverNames
	Kube  kubernetes.Interface
	// Recorder writes the events about PersistentVolumes.
	Recorder record.EventRecorder
	// Ops is the parent of every DeleteVolume and the writes recording it (P1).
	Ops context.Context
	// PluginCaps and ControllerCaps are the driver's capabilities: a driver that cannot
	// delete volumes is not asked to.
	PluginCaps     rpc.PluginCapabilitySet
	ControllerCaps rpc.ControllerCapabilitySet
	// DeleteVolume asks the driver to delete a volume, bounded by --timeout.
	DeleteVolume func(ctx context.Context, id string, secrets map[string]string) error
	// Holds says whether this process deletes the volume: a node deployment deletes those
	// of its node only. nil: every volume.
	Holds func(pv *v1.PersistentVolume) bool
	// Deleted counts a deletion in the provisioner's metrics.
	Deleted func(class string, start time.Time, err error)
	// CapacityChanged tells capacity tracking which capacity a deletion freed.
	CapacityChanged func(class string, topology []*csi.Topology)
}

// stepDeleteVolume is the step of a deletion that its PersistentVolume does not show: the
// driver deleted the volume, and the PersistentVolume is still to go.
const stepDeleteVolume = "DeleteVolume"

// New queues the driver's PersistentVolumes from informer's events, and the
// PersistentVolume of each VolumeAttachment that goes when attachments is not nil.
func New(cfg Config, queue *lifecycle.Queue[string], volumes *lifecycle.OwnWrites[*v1.PersistentVolume], informer cache.SharedInformer,
	classes storagelisters.StorageClassLister, attachments storagev1informers.VolumeAttachmentInformer) (*Deleter, error) {
	d := &Deleter{cfg: cfg, queue: queue, volumes: volumes, classes: classes}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    d.enqueue,
		UpdateFunc: func(_, obj any) { d.enqueue(obj) },
	}); err != nil {
		return nil, err
	}
	if attachments != nil {
		d.attachments = attachments.Lister()
		if _, err := attachments.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: d.enqueueAttached}); err != nil {
			return nil, err
		}
	}
	return d, nil
}

func (d *Deleter) enqueue(obj any) {
	if pv, ok := obj.(*v1.PersistentVolume); ok && request.IsDriverVolume(pv, d.cfg.Names) {
		d.queue.Add(pv.Name)
	}
}

// enqueueAttached wakes a deletion that waits for this attachment to go.
func (d *Deleter) enqueueAttached(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	if va, ok := obj.(*storagev1.VolumeAttachment); ok && va.Spec.Source.PersistentVolumeName != nil {
		d.queue.Add(*va.Spec.Source.PersistentVolumeName)
	}
}

// desiredFinalizers returns the PersistentVolume's finalizers as they should be: the
// provisioner's finalizer on bound volumes with reclaim policy Delete (so the volume is
// deleted before its PersistentVolume goes), none with Retain or Recycle. changed tells
// whether they differ from the current ones. Only the driver's volumes (request.IsDriverVolume)
// get here: each can be deleted, so the finalizer always goes again.
func desiredFinalizers(pv *v1.PersistentVolume) (finalizers []string, changed bool) {
	has := slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer)
	switch pv.Spec.PersistentVolumeReclaimPolicy {
	case v1.PersistentVolumeReclaimDelete:
		if !has && pv.DeletionTimestamp == nil && pv.Status.Phase == v1.VolumeBound {
			return append(slices.Clone(pv.Finalizers), volumehelpers.PVDeletionProtectionFinalizer), true
		}
	case v1.PersistentVolumeReclaimRetain, v1.PersistentVolumeReclaimRecycle:
		if has {
			return withoutFinalizer(pv.Finalizers), true
		}
	}
	return pv.Finalizers, false
}

func withoutFinalizer(finalizers []string) []string {
	return slices.DeleteFunc(slices.Clone(finalizers), func(f string) bool { return f == volumehelpers.PVDeletionProtectionFinalizer })
}

// shouldDelete tells whether the volume behind a PersistentVolume should be deleted now:
// released, reclaim policy Delete, and not already deleted (a PersistentVolume being
// deleted without the provisioner's finalizer was done with).
func shouldDelete(pv *v1.PersistentVolume) bool {
	switch {
	case pv.DeletionTimestamp != nil && !slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer):
		return false
	case pv.Status.Phase != v1.VolumeReleased:
		return false
	}
	return pv.Spec.PersistentVolumeReclaimPolicy == v1.PersistentVolumeReclaimDelete
}

// Sync is what happens to one PersistentVolume of the driver: keep its finalizer right,
// and when it is released with reclaim policy Delete, delete the volume and then the
// PersistentVolume.
//
// Every failure is logged here: the worker only requeues the volume, and a volume stuck
// Terminating with nothing in the log cannot be diagnosed.
//
// A PersistentVolume this process let go is missing from d.volumes until the informer
// shows it deleted, and one whose volume it deleted already comes with that step taken:
// no sync repeats a DeleteVolume or the writes after it. The memory is this process's
// only, which is enough for what it prevents (a retry, or a sync queued by the watch event
// of a write of ours that reads a cache older than the write); a new leader calls
// DeleteVolume once more, which CSI requires a driver to answer with success for a volume
// that is gone.
func (d *Deleter) Sync(name string) error {
	pv, exists, deletedAlready, err := d.volumes.GetTaken(name, stepDeleteVolume)
	if !exists || err != nil {
		return err
	}
	if !request.IsDriverVolume(pv, d.cfg.Names) {
		return nil
	}
	logger := klog.Background().WithValues("pv", name)
	ctx := klog.NewContext(d.cfg.Ops, logger)
	if finalizers, changed := desiredFinalizers(pv); changed {
		if pv, err = d.patchFinalizers(ctx, pv, finalizers); err != nil {
			logger.Error(err, "Cannot set the finalizers of the PersistentVolume, retrying")
			return err
		}
	}
	if !shouldDelete(pv) {
		return nil
	}
	// From here on the volume is seen as CSI sees it: an in-tree volume migrated to the
	// driver is translated (its handle, its topology), as upstream's Delete does.
	vol, migrated, err := request.CSIVolume(pv)
	if err != nil {
		logger.Error(err, "Volume deletion failed, retrying")
		d.cfg.Recorder.Event(pv, v1.EventTypeWarning, "VolumeFailedDelete", err.Error())
		return err
	}
	if d.cfg.Holds != nil && !d.cfg.Holds(vol) {
		// Another node's provisioner deletes it.
		return nil
	}
	start := time.Now()
	err = d.deleteWithPV(lifecycle.MarkMigrated(ctx, migrated), vol, deletedAlready)
	var pvErr pvRemovalError
	var attached stillAttachedError
	if !errors.As(err, &attached) {
		d.cfg.Deleted(pv.Spec.StorageClassName, start, err)
	}
	switch {
	case errors.As(err, &attached):
		// Expected when a workload and its claim are deleted together: postponed, not
		// failed, as upstream v6.4 (a Normal event, not counted as a failed deletion).
		logger.V(4).Info("Volume deletion postponed", "reason", err.Error())
		d.cfg.Recorder.Event(pv, v1.EventTypeNormal, "VolumeDelete", err.Error())
		return err
	case err == nil:
	case errors.As(err, &pvErr):
		// The volume is gone: the event a user reads on the PersistentVolume must not say
		// its deletion failed, and the retry does not call DeleteVolume again.
		logger.Error(err, "Volume deleted, but its PersistentVolume could not be removed; retrying")
	case lifecycle.NotStarted(err):
		// Draining or no longer leading: the driver was not asked; the next leader deletes.
		logger.V(2).Info("DeleteVolume not started; left to the next leader")
	default:
		logger.Error(err, "Volume deletion failed, retrying")
		d.cfg.Recorder.Event(pv, v1.EventTypeWarning, "VolumeFailedDelete", err.Error())
	}
	return err
}

// stillAttachedError postpones the deletion of a volume a VolumeAttachment still attaches
// to a node; the deletion is retried, and the detach's watch event enqueues it too.
type stillAttachedError struct{ pv, node string }

func (e stillAttachedError) Error() string {
	return fmt.Sprintf("persistentvolume %s is still attached to node %s, waiting for detach", e.pv, e.node)
}

// pvRemovalError is a failure to remove the PersistentVolume of a volume the driver has
// deleted already.
type pvRemovalError struct{ err error }

func (e pvRemovalError) Error() string { return e.err.Error() }
func (e pvRemovalError) Unwrap() error { return e.err }

// deleteWithPV deletes the volume, then the PersistentVolume, then lets it go by removing the
// finalizer, all on Ops() (P1). pv is the PersistentVolume as CSI sees it (request.CSIVolume).
// deletedAlready says that DeleteVolume succeeded for it in this process already: only the
// API writes after it are retried, the driver is not called again. Each step that succeeds is
// remembered in d.volumes (Took, Gone) until the informer shows the PersistentVolume gone.
func (d *Deleter) deleteWithPV(ctx context.Context, pv *v1.PersistentVolume, deletedAlready bool) error {
	logger := klog.FromContext(ctx)
	if deletedAlready {
		logger.V(4).Info("Volume deleted already, removing its PersistentVolume", "volumeHandle", pv.Spec.CSI.VolumeHandle)
	} else {
		if err := request.CheckCapabilities(d.cfg.PluginCaps, d.cfg.ControllerCaps, false); err != nil {
			return err
		}
		if node := d.AttachedTo(pv.Name); node != "" {
			// Deleting an attached volume would fail in the driver or, worse, succeed.
			return stillAttachedError{pv: pv.Name, node: node}
		}
		secrets := d.secrets(ctx, pv)
		if err := d.cfg.DeleteVolume(ctx, pv.Spec.CSI.VolumeHandle, secrets); err != nil {
			return fmt.Errorf("DeleteVolume %s: %w", pv.Spec.CSI.VolumeHandle, err)
		}
		d.volumes.Took(pv, stepDeleteVolume)
		logger.V(2).Info("Volume deleted", "volumeHandle", pv.Spec.CSI.VolumeHandle)
		d.cfg.CapacityChanged(pv.Spec.StorageClassName, volumeTopology(pv))
	}
	letGo, err := d.removePV(ctx, pv)
	if err != nil {
		return pvRemovalError{err}
	}
	if letGo {
		d.volumes.Gone(pv)
	}
	logger.V(2).Info("PersistentVolume deleted")
	return nil
}

// removePV deletes the PersistentVolume of a deleted volume and removes the provisioner's
// finalizer from it, on ctx (Ops()): two writes and no read, as upstream. The finalizer goes
// by a strategic merge patch that deletes only that entry, so it needs neither the resource
// version the Delete just changed nor a fresh read. letGo says that this PersistentVolume
// needs nothing more from the provisioner: the finalizer removal was written, or it had none,
// or the PersistentVolume is gone. A finalizer removal the API server refused as conflicting
// or invalid is not retried here; a later sync of the PersistentVolume sees what it is.
func (d *Deleter) removePV(ctx context.Context, pv *v1.PersistentVolume) (letGo bool, err error) {
	pvs := d.cfg.Kube.CoreV1().PersistentVolumes()
	if pv.DeletionTimestamp == nil {
		if err := pvs.Delete(ctx, pv.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &pv.UID}}); apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
			// Gone, or another PersistentVolume of the same name: not this one's to touch.
			return true, nil
		} else if err != nil {
			return false, fmt.Errorf("deleting PersistentVolume %s: %w", pv.Name, err)
		}
	}
	if !slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer) {
		return true, nil
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"uid":                                 pv.UID,
		"$deleteFromPrimitiveList/finalizers": []string{volumehelpers.PVDeletionProtectionFinalizer},
	}})
	if err != nil {
		return false, err
	}
	_, err = pvs.Patch(ctx, pv.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	switch {
	case err == nil, apierrors.IsNotFound(err):
		return true, nil
	case apierrors.IsConflict(err), apierrors.IsInvalid(err):
		// Another PersistentVolume of the name (its UID differs), or a write in the way.
		return false, nil
	}
	return false, fmt.Errorf("removing finalizer %s from PersistentVolume %s: %w", volumehelpers.PVDeletionProtectionFinalizer, pv.Name, err)
}

// AttachedTo names a node the volume is still attached to, "" for none (or when the
// driver does not publish).
func (d *Deleter) AttachedTo(pvName string) string {
	if d.attachments == nil {
		return ""
	}
	vas, err := d.attachments.List(labels.Everything())
	if err != nil {
		return ""
	}
	for _, va := range vas {
		if va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName == pvName {
			return va.Spec.NodeName
		}
	}
	return ""
}

// deletionSecrets reads the provisioner secret named by the PersistentVolume's annotations,
// or else by its StorageClass. A secret that cannot be read is logged and deletion goes on
// without it, as upstream: it may have been deleted on purpose.
func (d *Deleter) secrets(ctx context.Context, pv *v1.PersistentVolume) map[string]string {
	logger := klog.FromContext(ctx)
	var ref *v1.SecretReference
	name, hasName := pv.Annotations[request.AnnDeletionSecretName]
	namespace, hasNamespace := pv.Annotations[request.AnnDeletionSecretNamespace]
	switch {
	case hasName && hasNamespace:
		if name != "" && namespace != "" {
			ref = &v1.SecretReference{Name: name, Namespace: namespace}
		}
	case pv.Spec.ClaimRef != nil:
		class, err := d.classes.Get(volumehelpers.GetPersistentVolumeClass(pv))
		if err != nil {
			logger.Info("StorageClass not found, deleting without secrets", "err", err.Error())
			return nil
		}
		// An in-tree class is read in its CSI translation, as when the volume was made.
		if class, _, err = d.cfg.Names.CSIClass(class); err != nil {
			logger.Info("Cannot translate the StorageClass, deleting without secrets", "err", err.Error())
			return nil
		}
		claim := &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: pv.Spec.ClaimRef.Name, Namespace: pv.Spec.ClaimRef.Namespace}}
		if ref, err = request.SecretReference(request.ProvisionerSecret, class.Parameters, pv.Name, claim); err != nil {
			logger.Info("Cannot resolve the provisioner secret, deleting without secrets", "err", err.Error())
			return nil
		}
	}
	secrets, err := request.ReadSecret(ctx, d.cfg.Kube, ref)
	if err != nil {
		logger.Error(err, "Cannot read the deletion secret, deleting without it")
	}
	return secrets
}

// patchFinalizers sets the PersistentVolume's finalizers, on Ops(). It patches: upstream's
// RBAC grants patch on persistentvolumes, not update.
func (d *Deleter) patchFinalizers(ctx context.Context, pv *v1.PersistentVolume, finalizers []string) (*v1.PersistentVolume, error) {
	patch, err := finalizerPatch(pv, finalizers)
	if err != nil {
		return pv, err
	}
	updated, err := d.cfg.Kube.CoreV1().PersistentVolumes().Patch(ctx, pv.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil {
		return pv, fmt.Errorf("setting finalizers %v on PersistentVolume %s: %w", finalizers, pv.Name, err)
	}
	return updated, nil
}

// finalizerPatch is a JSON merge patch that sets the finalizers, guarded by the resource
// version so that a concurrent change is not overwritten.
func finalizerPatch(pv *v1.PersistentVolume, finalizers []string) ([]byte, error) {
	if finalizers == nil {
		finalizers = []string{}
	}
	return json.Marshal(map[string]any{"metadata": map[string]any{"finalizers": finalizers, "resourceVersion": pv.ResourceVersion}})
}

// volumeTopology is the topology of a volume as its PersistentVolume's node affinity says
// it (one segment per term); nil, meaning every segment, when there is none or a term is
// not a plain key=value selection.
func volumeTopology(pv *v1.PersistentVolume) []*csi.Topology {
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return nil
	}
	var out []*csi.Topology
	for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		segment := map[string]string{}
		for _, e := range term.MatchExpressions {
			if e.Operator != v1.NodeSelectorOpIn || len(e.Values) != 1 {
				return nil
			}
			segment[e.Key] = e.Values[0]
		}
		out = append(out, &csi.Topology{Segments: segment})
	}
	return out
}

// Queue is the deleter's queue, by PersistentVolume name, for the workers that run Sync.
func (d *Deleter) Queue() *lifecycle.Queue[string] { return d.queue }
