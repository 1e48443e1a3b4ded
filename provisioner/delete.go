package provisioner

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"
)

// syncVolume is what happens to one PersistentVolume of the driver: keep its finalizer
// right, and when it is released with reclaim policy Delete, delete the volume and then the
// PersistentVolume.
func (c *controller) syncVolume(name string) error {
	pv, err := c.volumes.Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	} else if err != nil {
		return err
	}
	if !isDriverVolume(pv, c.driver) {
		return nil
	}
	ctx := klog.NewContext(c.ops, klog.Background().WithValues("pv", name))
	if finalizers, changed := desiredFinalizers(pv); changed {
		if pv, err = c.patchFinalizers(ctx, pv, finalizers); err != nil {
			return err
		}
	}
	if !shouldDelete(pv) {
		return nil
	}
	if c.node != nil && !c.node.holds(pv) {
		// Another node's provisioner deletes it.
		return nil
	}
	start := time.Now()
	err = c.delete(ctx, pv)
	c.metrics.deleted(pv.Spec.StorageClassName, start, err)
	if err != nil {
		c.recorder.Event(pv, v1.EventTypeWarning, "VolumeFailedDelete", err.Error())
		return err
	}
	return nil
}

// delete deletes the volume, then the PersistentVolume, then lets it go by removing the
// finalizer, all on Ops() (P1).
func (c *controller) delete(ctx context.Context, pv *v1.PersistentVolume) error {
	logger := klog.FromContext(ctx)
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
	logger.V(2).Info("Volume deleted", "volumeHandle", pv.Spec.CSI.VolumeHandle)
	c.capacityChanged(pv.Spec.StorageClassName, volumeTopology(pv))
	apiCtx, cancel := context.WithTimeout(ctx, c.opts.timeout)
	defer cancel()
	if err := c.kube.CoreV1().PersistentVolumes().Delete(apiCtx, pv.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting PersistentVolume %s: %w", pv.Name, err)
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		current, err := c.kube.CoreV1().PersistentVolumes().Get(apiCtx, pv.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !slices.Contains(current.Finalizers, volumehelpers.PVDeletionProtectionFinalizer) {
			return nil
		}
		current.Finalizers = withoutFinalizer(current.Finalizers)
		_, err = c.kube.CoreV1().PersistentVolumes().Update(apiCtx, current, metav1.UpdateOptions{})
		return err
	})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("removing finalizer %s from PersistentVolume %s: %w", volumehelpers.PVDeletionProtectionFinalizer, pv.Name, err)
	}
	logger.V(2).Info("PersistentVolume deleted")
	return nil
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
		claim := &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: pv.Spec.ClaimRef.Name, Namespace: pv.Spec.ClaimRef.Namespace}}
		if ref, err = secretReference(provisionerSecret, class.Parameters, pv.Name, claim); err != nil {
			logger.Info("Cannot resolve the provisioner secret, deleting without secrets", "err", err.Error())
			return nil
		}
	}
	apiCtx, cancel := context.WithTimeout(ctx, c.opts.timeout)
	defer cancel()
	secrets, err := readSecret(apiCtx, c.kube, ref)
	if err != nil {
		logger.Error(err, "Cannot read the deletion secret, deleting without it")
	}
	return secrets
}

// patchFinalizers sets the PersistentVolume's finalizers, on Ops().
func (c *controller) patchFinalizers(ctx context.Context, pv *v1.PersistentVolume, finalizers []string) (*v1.PersistentVolume, error) {
	patch, err := finalizerPatch(pv, finalizers)
	if err != nil {
		return pv, err
	}
	ctx, cancel := context.WithTimeout(ctx, c.opts.timeout)
	defer cancel()
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
