// Package pvfinalizer lets the attacher's finalizer go from PersistentVolumes. The
// attacher puts it on a PV before it publishes the PV's volume, so that the PV outlives
// its attachments; the Releaser removes it once the PV may let it go (it is being deleted,
// or it is an in-tree PV no longer migrated to this driver) and no VolumeAttachment
// references the PV any more.
//
// The Releaser queues PVs from the PV informer's events and from VolumeAttachments that
// go; the attacher runs its workers on that queue. The removal is written on Ops() (P1).
// The attacher hands it plain values and funcs (Config).
package pvfinalizer

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/labels"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/attacher/finalizer"
	"github.com/csi-sidecars/csi-sidecars/attacher/volume"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Config is what the Releaser needs from the attacher. Every field is required.
type Config struct {
	// Driver is the driver's name: its finalizer, and the migrations to it.
	Driver string
	// Ops is the context of the writes (P1).
	Ops context.Context
	// Translator tells in-tree PVs apart.
	Translator volume.Translator
	// PVs is the PV cache read through the attacher's own writes.
	PVs *lifecycle.OwnWrites[*corev1.PersistentVolume]
	// VAs lists the VolumeAttachments that may still reference a PV.
	VAs storagelisters.VolumeAttachmentLister
	// Patch writes updated over old and records the write in PVs.
	Patch func(ctx context.Context, old, updated *corev1.PersistentVolume) (*corev1.PersistentVolume, error)
}

// Releaser removes the attacher's finalizer from PVs that no longer need it.
type Releaser struct {
	cfg       Config
	finalizer string
	queue     *lifecycle.Queue[string]
}

// New queues PVs on queue, by name, from the events of pvs and of vas (a deleted
// VolumeAttachment's PV), with the attacher's resync period.
func New(cfg Config, queue *lifecycle.Queue[string], pvs, vas cache.SharedInformer, resync time.Duration) (*Releaser, error) {
	r := &Releaser{cfg: cfg, finalizer: finalizer.Name(cfg.Driver), queue: queue}
	if _, err := pvs.AddEventHandlerWithResyncPeriod(cache.ResourceEventHandlerFuncs{
		AddFunc:    r.changed,
		UpdateFunc: func(_, obj any) { r.changed(obj) },
	}, resync); err != nil {
		return nil, fmt.Errorf("watching PersistentVolumes: %w", err)
	}
	if _, err := vas.AddEventHandlerWithResyncPeriod(cache.ResourceEventHandlerFuncs{
		DeleteFunc: r.attachmentGone,
	}, resync); err != nil {
		return nil, fmt.Errorf("watching VolumeAttachments for their PersistentVolumes: %w", err)
	}
	return r, nil
}

func (r *Releaser) changed(obj any) {
	if pv, ok := obj.(*corev1.PersistentVolume); ok && r.mayGo(pv) {
		r.queue.Add(pv.Name)
	}
}

// attachmentGone queues the PV of a deleted VolumeAttachment: its finalizer may go once
// no VolumeAttachment needs it.
func (r *Releaser) attachmentGone(obj any) {
	if gone, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = gone.Obj
	}
	if va, ok := obj.(*storagev1.VolumeAttachment); ok && va.Spec.Source.PersistentVolumeName != nil {
		r.queue.Add(*va.Spec.Source.PersistentVolumeName)
	}
}

// mayGo tells whether a PV carries our finalizer and no longer needs it unless a
// VolumeAttachment uses it: the PV is being deleted, or it is an in-tree PV that is not
// (or no longer) migrated to this driver, for example after a rollback of migration.
func (r *Releaser) mayGo(pv *corev1.PersistentVolume) bool {
	if !finalizer.Has(pv.Finalizers, r.finalizer) {
		return false
	}
	if pv.DeletionTimestamp != nil {
		return true
	}
	return r.cfg.Translator.IsPVMigratable(pv) && pv.Annotations[volume.MigratedToAnnotation] != r.cfg.Driver
}

// Sync removes our finalizer from the PV name if it may let it go and no VolumeAttachment
// references the PV any more.
func (r *Releaser) Sync(name string) error {
	pv, ok, err := r.cfg.PVs.Get(name)
	if err != nil {
		return fmt.Errorf("getting PersistentVolume %s from the cache: %w", name, err)
	}
	if !ok || !r.mayGo(pv) {
		return nil
	}
	vas, err := r.cfg.VAs.List(labels.Everything())
	if err != nil {
		return fmt.Errorf("listing VolumeAttachments: %w", err)
	}
	for _, va := range vas {
		if pvName := va.Spec.Source.PersistentVolumeName; pvName != nil && *pvName == pv.Name {
			return nil // its deletion queues the PV again
		}
	}
	ctx := r.cfg.Ops
	clone := pv.DeepCopy()
	clone.Finalizers = finalizer.Without(pv.Finalizers, r.finalizer)
	if _, err := r.cfg.Patch(ctx, pv, clone); err != nil {
		return fmt.Errorf("removing the finalizer: %w", err)
	}
	klog.FromContext(ctx).V(2).Info("Removed finalizer from PersistentVolume", "PersistentVolume", name)
	return nil
}
