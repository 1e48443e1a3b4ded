package provisioner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"
)

// syncVolume is what happens to one PersistentVolume of the driver: keep its finalizer
// right, and when it is released with reclaim policy Delete, delete the volume and then the
// PersistentVolume.
//
// Every failure is logged here: the worker only requeues the volume, and a volume stuck
// Terminating with nothing in the log cannot be diagnosed.
func (c *controller) syncVolume(name string) error {
	pv, err := c.volumes.Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	} else if err != nil {
		return err
	}
	if !isDriverVolume(pv, c.names()) {
		return nil
	}
	logger := klog.Background().WithValues("pv", name)
	ctx := klog.NewContext(c.ops, logger)
	if finalizers, changed := desiredFinalizers(pv); changed {
		if pv, err = c.patchFinalizers(ctx, pv, finalizers); err != nil {
			logger.Error(err, "Cannot set the finalizers of the PersistentVolume, retrying")
			return err
		}
	}
	if !shouldDelete(pv) {
		return nil
	}
	// From here on the volume is seen as CSI sees it: an in-tree volume migrated to the
	// driver is translated (its handle, its topology), as upstream's Delete does.
	vol, migrated, err := csiVolume(pv)
	if err != nil {
		logger.Error(err, "Volume deletion failed, retrying")
		c.recorder.Event(pv, v1.EventTypeWarning, "VolumeFailedDelete", err.Error())
		return err
	}
	if c.node != nil && !c.node.holds(vol) {
		// Another node's provisioner deletes it.
		return nil
	}
	start := time.Now()
	err = c.delete(lifecycle.MarkMigrated(ctx, migrated), vol)
	c.metrics.deleted(pv.Spec.StorageClassName, start, err)
	var pvErr pvRemovalError
	switch {
	case err == nil:
	case errors.As(err, &pvErr):
		// The volume is gone: the event a user reads on the PersistentVolume must not say
		// its deletion failed, and the retry does not call DeleteVolume again.
		logger.Error(err, "Volume deleted, but its PersistentVolume could not be removed; retrying")
	default:
		logger.Error(err, "Volume deletion failed, retrying")
		c.recorder.Event(pv, v1.EventTypeWarning, "VolumeFailedDelete", err.Error())
	}
	return err
}

// pvRemovalError is a failure to remove the PersistentVolume of a volume the driver has
// deleted already.
type pvRemovalError struct{ err error }

func (e pvRemovalError) Error() string { return e.err.Error() }
func (e pvRemovalError) Unwrap() error { return e.err }

// delete deletes the volume, then the PersistentVolume, then lets it go by removing the
// finalizer, all on Ops() (P1). pv is the PersistentVolume as CSI sees it (csiVolume). A DeleteVolume that succeeded is not repeated when only the
// API writes after it are retried (deletedVolumes).
func (c *controller) delete(ctx context.Context, pv *v1.PersistentVolume) error {
	logger := klog.FromContext(ctx)
	if c.volumeDeleted(pv) {
		logger.V(4).Info("Volume deleted already, removing its PersistentVolume", "volumeHandle", pv.Spec.CSI.VolumeHandle)
	} else {
		if err := checkCapabilities(c.pluginCaps, c.controllerCaps, false); err != nil {
			return err
		}
		if node := c.attachedTo(pv.Name); node != "" {
			// Deleting an attached volume would fail in the driver or, worse, succeed.
			return fmt.Errorf("persistentvolume %s is still attached to node %s", pv.Name, node)
		}
		secrets := c.deletionSecrets(ctx, pv)
		if err := c.deleteBackendVolume(ctx, pv.Spec.CSI.VolumeHandle, secrets); err != nil {
			return fmt.Errorf("DeleteVolume %s: %w", pv.Spec.CSI.VolumeHandle, err)
		}
		c.rememberDeleted(pv)
		logger.V(2).Info("Volume deleted", "volumeHandle", pv.Spec.CSI.VolumeHandle)
		c.capacityChanged(pv.Spec.StorageClassName, volumeTopology(pv))
	}
	if err := c.removePV(ctx, pv); err != nil {
		return pvRemovalError{err}
	}
	logger.V(2).Info("PersistentVolume deleted")
	return nil
}

// removePV deletes the PersistentVolume of a deleted volume and removes the provisioner's
// finalizer from it, on ctx (Ops()): two writes and no read, as upstream. The finalizer goes
// by a strategic merge patch that deletes only that entry, so it needs neither the resource
// version the Delete just changed nor a fresh read.
func (c *controller) removePV(ctx context.Context, pv *v1.PersistentVolume) error {
	pvs := c.kube.CoreV1().PersistentVolumes()
	if pv.DeletionTimestamp == nil {
		if err := pvs.Delete(ctx, pv.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &pv.UID}}); apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
			// Gone, or another PersistentVolume of the same name: not this one's to touch.
			return nil
		} else if err != nil {
			return fmt.Errorf("deleting PersistentVolume %s: %w", pv.Name, err)
		}
	}
	if !slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer) {
		return nil
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"uid":                                 pv.UID,
		"$deleteFromPrimitiveList/finalizers": []string{volumehelpers.PVDeletionProtectionFinalizer},
	}})
	if err != nil {
		return err
	}
	_, err = pvs.Patch(ctx, pv.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) && !apierrors.IsInvalid(err) {
		// NotFound, or another PersistentVolume of the name (its UID differs): done.
		return fmt.Errorf("removing finalizer %s from PersistentVolume %s: %w", volumehelpers.PVDeletionProtectionFinalizer, pv.Name, err)
	}
	return nil
}

// deletedKey names one PersistentVolume: a PersistentVolume re-created under the same
// name is another volume.
type deletedKey struct {
	name string
	uid  types.UID
}

func deletedKeyOf(pv *v1.PersistentVolume) deletedKey { return deletedKey{pv.Name, pv.UID} }

// volumeDeleted tells whether DeleteVolume succeeded for this PersistentVolume in this
// process. It is memory only, which is enough for what it prevents: the retries of the API
// writes that follow DeleteVolume, by the same worker queue. A new leader calls DeleteVolume
// once more, which CSI requires a driver to answer with success for a volume that is gone.
func (c *controller) volumeDeleted(pv *v1.PersistentVolume) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.deletedVolumes[deletedKeyOf(pv)]
	return ok
}

func (c *controller) rememberDeleted(pv *v1.PersistentVolume) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.deletedVolumes[deletedKeyOf(pv)] = struct{}{}
}

// forgetDeletedVolume drops the memory of a PersistentVolume once the informer saw it go.
func (c *controller) forgetDeletedVolume(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	if pv, ok := obj.(*v1.PersistentVolume); ok {
		c.mu.Lock()
		delete(c.deletedVolumes, deletedKeyOf(pv))
		c.mu.Unlock()
	}
}

// attachedTo names a node the volume is still attached to, "" for none (or when the
// driver does not publish).
func (c *controller) attachedTo(pvName string) string {
	if c.attachments == nil {
		return ""
	}
	vas, err := c.attachments.List(labels.Everything())
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
func (c *controller) deletionSecrets(ctx context.Context, pv *v1.PersistentVolume) map[string]string {
	logger := klog.FromContext(ctx)
	var ref *v1.SecretReference
	name, hasName := pv.Annotations[annDeletionSecretName]
	namespace, hasNamespace := pv.Annotations[annDeletionSecretNamespace]
	switch {
	case hasName && hasNamespace:
		if name != "" && namespace != "" {
			ref = &v1.SecretReference{Name: name, Namespace: namespace}
		}
	case pv.Spec.ClaimRef != nil:
		class, err := c.classes.Get(volumehelpers.GetPersistentVolumeClass(pv))
		if err != nil {
			logger.Info("StorageClass not found, deleting without secrets", "err", err.Error())
			return nil
		}
		// An in-tree class is read in its CSI translation, as when the volume was made.
		if class, _, err = c.names().csiClass(class); err != nil {
			logger.Info("Cannot translate the StorageClass, deleting without secrets", "err", err.Error())
			return nil
		}
		claim := &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: pv.Spec.ClaimRef.Name, Namespace: pv.Spec.ClaimRef.Namespace}}
		if ref, err = secretReference(provisionerSecret, class.Parameters, pv.Name, claim); err != nil {
			logger.Info("Cannot resolve the provisioner secret, deleting without secrets", "err", err.Error())
			return nil
		}
	}
	secrets, err := readSecret(ctx, c.kube, ref)
	if err != nil {
		logger.Error(err, "Cannot read the deletion secret, deleting without it")
	}
	return secrets
}

// patchFinalizers sets the PersistentVolume's finalizers, on Ops(). It patches: upstream's
// RBAC grants patch on persistentvolumes, not update.
func (c *controller) patchFinalizers(ctx context.Context, pv *v1.PersistentVolume, finalizers []string) (*v1.PersistentVolume, error) {
	patch, err := finalizerPatch(pv, finalizers)
	if err != nil {
		return pv, err
	}
	updated, err := c.kube.CoreV1().PersistentVolumes().Patch(ctx, pv.Name, types.MergePatchType, patch, metav1.PatchOptions{})
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
