// Package reconcile is the attacher's ListVolumes reconciler: every --reconcile-sync it
// compares where the driver says each volume is published with what the
// VolumeAttachments say, and forces a sync of each VolumeAttachment that disagrees; that
// sync publishes or unpublishes again. The reconciler itself writes nothing and reads only
// caches besides ListVolumes, so it never races the workers. ListVolumes runs on Ops()
// (P1). The attacher hands it plain values and funcs (Config).
package reconcile

import (
	"context"
	"fmt"
	"slices"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/wait"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/attacher/volume"
)

// Config is what the reconciler needs from the attacher. Every field is required.
type Config struct {
	// Driver is the driver's name; other drivers' VolumeAttachments are left alone.
	Driver string
	// Ops is the context of ListVolumes (P1).
	Ops context.Context
	// Interval is --reconcile-sync.
	Interval time.Duration
	// VAs and PVs are the caches of VolumeAttachments and PVs.
	VAs storagelisters.VolumeAttachmentLister
	PVs corelisters.PersistentVolumeLister
	// Translator resolves in-tree PVs and repairs their translated volume handles.
	Translator volume.Translator
	// NodeID is the driver's ID of a VolumeAttachment's node, from caches only.
	NodeID func(va *storagev1.VolumeAttachment) (string, error)
	// List returns, by volume handle, the nodes the driver published each volume to.
	List func(ctx context.Context) (map[string][]string, error)
	// Force makes the next sync of va call the driver and queues it.
	Force func(va *storagev1.VolumeAttachment)
}

// Reconciler forces the syncs of VolumeAttachments the driver disagrees with.
type Reconciler struct {
	cfg Config
}

// New returns the reconciler.
func New(cfg Config) *Reconciler { return &Reconciler{cfg: cfg} }

// Run compares the VolumeAttachments with the driver every Interval until intake ends.
func (r *Reconciler) Run(intake context.Context) {
	wait.UntilWithContext(intake, func(context.Context) {
		if err := r.Once(); err != nil {
			klog.FromContext(r.cfg.Ops).Error(err, "Failed to reconcile VolumeAttachments with the driver")
		}
	}, r.cfg.Interval)
}

// Once lists where the driver has published each volume and forces a sync of every
// VolumeAttachment whose status.attached disagrees.
func (r *Reconciler) Once() error {
	ctx := r.cfg.Ops
	published, err := r.cfg.List(ctx)
	if err != nil {
		return err
	}
	vas, err := r.cfg.VAs.List(labels.Everything())
	if err != nil {
		return fmt.Errorf("listing VolumeAttachments: %w", err)
	}
	logger := klog.FromContext(ctx)
	for _, va := range vas {
		if va.Spec.Attacher != r.cfg.Driver {
			continue
		}
		handle, nodeID, err := r.publishedAs(logger, va)
		if err != nil {
			logger.V(4).Info("Cannot reconcile VolumeAttachment", "VolumeAttachment", va.Name, "err", err.Error())
			continue
		}
		found := slices.Contains(published[handle], nodeID)
		if va.Status.Attached != found {
			logger.Info("VolumeAttachment disagrees with the driver, forcing a sync",
				"VolumeAttachment", va.Name, "volumeHandle", handle, "attached", va.Status.Attached, "published", found)
			r.cfg.Force(va)
		}
	}
	return nil
}

// publishedAs is the volume handle and node ID a VolumeAttachment is published with, from
// the caches only (the reconciler makes no API reads).
func (r *Reconciler) publishedAs(logger klog.Logger, va *storagev1.VolumeAttachment) (handle, nodeID string, err error) {
	if nodeID, err = r.cfg.NodeID(va); err != nil {
		return "", "", err
	}
	vol, inline, err := volume.Inline(va)
	if err != nil {
		return "", "", err
	}
	if !inline {
		pv, err := r.cfg.PVs.Get(*va.Spec.Source.PersistentVolumeName)
		if err != nil {
			return "", "", err
		}
		if vol, err = volume.FromPV(logger, r.cfg.Translator, pv); err != nil {
			return "", "", err
		}
	}
	handle = vol.Source.VolumeHandle
	if vol.Migrated {
		// Translated handles of some in-tree plugins differ from what the driver lists.
		if handle, err = r.cfg.Translator.RepairVolumeHandle(vol.Source.Driver, handle, nodeID); err != nil {
			return "", "", fmt.Errorf("repairing volume handle %s: %w", vol.Source.VolumeHandle, err)
		}
	}
	return handle, nodeID, nil
}
