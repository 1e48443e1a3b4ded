package attacher

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/attacher/csicall"
	"github.com/csi-sidecars/csi-sidecars/attacher/finalizer"
	"github.com/csi-sidecars/csi-sidecars/attacher/nodeid"
	"github.com/csi-sidecars/csi-sidecars/attacher/patch"
	"github.com/csi-sidecars/csi-sidecars/attacher/volume"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// syncer is what one sync of a VolumeAttachment does: it publishes or unpublishes the
// volume and records the outcome, from the parts (volume, nodeid, csicall, patch). The
// Controller decides when, on which worker, and whether the reconciler forced it.
type syncer struct {
	config
	kube  kubernetes.Interface
	tr    volume.Translator
	calls *csicall.Driver
	write *patch.Writer
	// nodes and pvs are nil for the trivial handler, which reads neither.
	nodes *nodeid.Lookup
	// pvs is the PV cache read through this controller's own writes, as the
	// Controller's VolumeAttachments are.
	pvs *lifecycle.OwnWrites[*corev1.PersistentVolume]
	// intake is run's, set before its workers start: the writes that start an attach end
	// with it (startingWork).
	intake context.Context
}

// trivial marks a VolumeAttachment attached without a CSI call or a finalizer: the
// driver has nothing to publish.
func (s *syncer) trivial(ctx context.Context, va *storagev1.VolumeAttachment) error {
	if va.Status.Attached {
		return nil
	}
	if _, err := s.write.Attached(ctx, va, nil); err != nil {
		return fmt.Errorf("failed to mark as attached: %w", err)
	}
	return nil
}

func (s *syncer) attach(ctx context.Context, va *storagev1.VolumeAttachment, forced bool) error {
	if va.Status.Attached && !forced {
		return nil
	}
	logger := klog.FromContext(ctx)
	logger.V(2).Info("Attaching")
	va, metadata, err := s.publish(ctx, va)
	if err != nil {
		s.write.Failure(ctx, va, err, func(st *storagev1.VolumeAttachmentStatus, ve *storagev1.VolumeError) {
			st.AttachError = ve
		})
		return fmt.Errorf("failed to attach: %w", err)
	}
	logger.V(2).Info("Attached")
	if _, err := s.write.Attached(ctx, va, metadata); err != nil {
		return fmt.Errorf("failed to mark as attached: %w", err)
	}
	return nil
}

// publish checks everything it can before it adds the finalizer (which would block the
// VolumeAttachment's deletion), then publishes. It returns the VolumeAttachment as last
// written.
func (s *syncer) publish(ctx context.Context, va *storagev1.VolumeAttachment) (*storagev1.VolumeAttachment, map[string]string, error) {
	vol, err := s.volumeToAttach(ctx, va)
	if err != nil {
		return va, nil, err
	}
	readonly := vol.Source.ReadOnly && s.publishReadOnly // the spec: false unless PUBLISH_READONLY
	capability, err := volume.Capability(vol.Spec, s.singleNodeMultiWriter, s.defaultFSType)
	if err != nil {
		return va, nil, err
	}
	secrets, err := publishSecrets(ctx, s.kube, vol.Source.ControllerPublishSecretRef)
	if err != nil {
		return va, nil, err
	}
	nodeID, err := s.nodes.Find(ctx, va, false)
	if err != nil {
		return va, nil, err
	}
	ours := finalizer.Name(s.driver)
	clone := va.DeepCopy()
	if !finalizer.Has(clone.Finalizers, ours) {
		clone.Finalizers = append(clone.Finalizers, ours)
	}
	if clone.Annotations[nodeid.Annotation] != nodeID {
		if clone.Annotations == nil {
			clone.Annotations = map[string]string{}
		}
		clone.Annotations[nodeid.Annotation] = nodeID
	}
	wctx, cancel := s.startingWork(ctx)
	va, err = s.write.VA(wctx, va, clone, false)
	cancel()
	if err != nil {
		return va, nil, lifecycle.IfNotStarted(wctx, fmt.Errorf("could not save VolumeAttachment: %w", err))
	}
	// csi-lib-utils' interceptor on the connection logs the call at -v=5, as upstream's.
	metadata, err := s.calls.Publish(ctx, vol.Migrated, &csi.ControllerPublishVolumeRequest{
		VolumeId:         vol.Source.VolumeHandle,
		NodeId:           nodeID,
		VolumeCapability: capability,
		Readonly:         readonly,
		VolumeContext:    vol.Source.VolumeAttributes,
		Secrets:          secrets,
	})
	if err != nil {
		return va, nil, err
	}
	return va, metadata, nil
}

// startingWork is the context of the writes that start an attach (the finalizers): they
// end with intake and wait behind the writes that finish work (P14).
func (s *syncer) startingWork(ctx context.Context) (context.Context, context.CancelFunc) {
	intake := s.intake
	if intake == nil {
		// Tests that sync without run.
		intake = context.Background()
	}
	return lifecycle.StartingWork(ctx, intake)
}

// volumeToAttach resolves the volume and, for a PV, refuses one being deleted and adds our
// finalizer to it, so the PV outlives the attachment.
func (s *syncer) volumeToAttach(ctx context.Context, va *storagev1.VolumeAttachment) (*volume.Volume, error) {
	if vol, inline, err := volume.Inline(va); inline {
		return vol, err
	}
	pv, err := s.cachedPV(*va.Spec.Source.PersistentVolumeName)
	if err != nil {
		return nil, err
	}
	if pv.DeletionTimestamp != nil {
		return nil, fmt.Errorf("PersistentVolume %q is marked for deletion", pv.Name)
	}
	if ours := finalizer.Name(s.driver); !finalizer.Has(pv.Finalizers, ours) {
		clone := pv.DeepCopy()
		clone.Finalizers = append(clone.Finalizers, ours)
		wctx, cancel := s.startingWork(ctx)
		defer cancel()
		if pv, err = s.write.PV(wctx, pv, clone); err != nil {
			return nil, lifecycle.IfNotStarted(wctx, fmt.Errorf("could not add PersistentVolume finalizer: %w", err))
		}
	}
	return volume.FromPV(klog.FromContext(ctx), s.tr, pv)
}

func (s *syncer) detach(ctx context.Context, va *storagev1.VolumeAttachment, forced bool) error {
	if !finalizer.Has(va.Finalizers, finalizer.Name(s.driver)) && !forced {
		return nil
	}
	logger := klog.FromContext(ctx)
	logger.V(2).Info("Detaching")
	if err := s.unpublish(ctx, va); err != nil {
		s.write.Failure(ctx, va, err, func(st *storagev1.VolumeAttachmentStatus, ve *storagev1.VolumeError) {
			ve.ErrorCode = nil // upstream records the code of attach errors only
			st.DetachError = ve
		})
		return fmt.Errorf("failed to detach: %w", err)
	}
	logger.V(2).Info("Detached")
	// Every write is recorded as it returns (patch.Writer), also when the status write
	// failed after the finalizer was removed: a retry from a stale copy, which still shows
	// the finalizer, would unpublish again.
	return s.write.Detached(ctx, va)
}

func (s *syncer) unpublish(ctx context.Context, va *storagev1.VolumeAttachment) error {
	vol, inline, err := volume.Inline(va)
	if err != nil {
		return err
	}
	if !inline {
		pv, err := s.cachedPV(*va.Spec.Source.PersistentVolumeName)
		if err != nil {
			return err
		}
		if vol, err = volume.FromPV(klog.FromContext(ctx), s.tr, pv); err != nil {
			return err
		}
	}
	secrets, err := publishSecrets(ctx, s.kube, vol.Source.ControllerPublishSecretRef)
	if err != nil {
		return err
	}
	nodeID, err := s.nodes.Find(ctx, va, true)
	if err != nil {
		return err
	}
	return s.calls.Unpublish(ctx, vol.Migrated, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol.Source.VolumeHandle, NodeId: nodeID, Secrets: secrets})
}

// cachedPV is the PV name as the cache or this controller's last write of it knows it, the
// newer; a NotFound error when the cache has none.
func (s *syncer) cachedPV(name string) (*corev1.PersistentVolume, error) {
	pv, ok, err := s.pvs.Get(name)
	if err != nil {
		return nil, fmt.Errorf("getting PersistentVolume %s from the cache: %w", name, err)
	}
	if !ok {
		return nil, apierrors.NewNotFound(corev1.Resource("persistentvolumes"), name)
	}
	return pv, nil
}

// publishSecrets reads the ControllerPublishSecretRef secret; nil without one.
func publishSecrets(ctx context.Context, kube kubernetes.Interface, ref *corev1.SecretReference) (map[string]string, error) {
	if ref == nil {
		return nil, nil
	}
	secret, err := lifecycle.GetSecret(ctx, kube, ref.Namespace, ref.Name)
	if err != nil {
		return nil, fmt.Errorf("failed to load secret \"%s/%s\": %w", ref.Namespace, ref.Name, err)
	}
	out := make(map[string]string, len(secret.Data))
	for k, v := range secret.Data {
		out[k] = string(v)
	}
	return out, nil
}
