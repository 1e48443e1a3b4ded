package attacher

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
)

// runReconciler compares the VolumeAttachments with the driver every --reconcile-sync
// until intake ends.
func (c *Controller) runReconciler(intake context.Context) {
	wait.UntilWithContext(intake, func(context.Context) {
		if err := c.reconcileOnce(); err != nil {
			klog.FromContext(c.ops).Error(err, "Failed to reconcile VolumeAttachments with the driver")
		}
	}, c.reconcileSync)
}

// reconcileOnce lists where the driver has published each volume and forces a sync of
// every VolumeAttachment whose status.attached disagrees: the sync publishes or
// unpublishes again. The reconciler itself writes nothing, so it never races the workers.
func (c *Controller) reconcileOnce() error {
	// P1: ListVolumes is a CSI call too; it runs on Ops().
	ctx, cancel := context.WithTimeout(c.ops, c.timeout)
	defer cancel()
	published, err := c.listPublished(ctx)
	if err != nil {
		return err
	}
	vas, err := c.vaLister.List(labels.Everything())
	if err != nil {
		return fmt.Errorf("listing VolumeAttachments: %w", err)
	}
	logger := klog.FromContext(ctx)
	for _, va := range vas {
		if va.Spec.Attacher != c.driver {
			continue
		}
		handle, nodeID, err := c.publishedAs(logger, va)
		if err != nil {
			logger.V(4).Info("Cannot reconcile VolumeAttachment", "VolumeAttachment", va.Name, "err", err.Error())
			continue
		}
		found := publishedTo(published, handle, nodeID)
		if va.Status.Attached != found {
			logger.Info("VolumeAttachment disagrees with the driver, forcing a sync",
				"VolumeAttachment", va.Name, "volumeHandle", handle, "attached", va.Status.Attached, "published", found)
			c.setForceSync(va.Name)
			c.enqueue(va)
		}
	}
	return nil
}

// publishedAs is the volume handle and node ID a VolumeAttachment is published with, from
// the caches only (the reconciler makes no API reads).
func (c *Controller) publishedAs(logger klog.Logger, va *storagev1.VolumeAttachment) (handle, nodeID string, err error) {
	nodeID, ok := "", false
	if csiNode, err := c.csiNodeLister.Get(va.Spec.NodeName); err == nil {
		nodeID, ok = nodeIDFromCSINode(c.driver, csiNode)
	}
	if !ok {
		if nodeID, ok = va.Annotations[nodeIDAnnotation]; !ok {
			return "", "", fmt.Errorf("no node ID for node %s", va.Spec.NodeName)
		}
	}
	vol, inline, err := inlineVolume(va)
	if err != nil {
		return "", "", err
	}
	if !inline {
		pv, err := c.pvLister.Get(*va.Spec.Source.PersistentVolumeName)
		if err != nil {
			return "", "", err
		}
		if vol, err = pvVolume(logger, c.tr, pv); err != nil {
			return "", "", err
		}
	}
	handle = vol.source.VolumeHandle
	if vol.migrated {
		// Translated handles of some in-tree plugins differ from what the driver lists.
		if handle, err = c.tr.RepairVolumeHandle(vol.source.Driver, handle, nodeID); err != nil {
			return "", "", fmt.Errorf("repairing volume handle %s: %w", vol.source.VolumeHandle, err)
		}
	}
	return handle, nodeID, nil
}

// listPage is the ListVolumes page size when --max-entries is 0. Upstream then asks for every
// volume in one answer, which past some ten thousand volumes exceeds gRPC's 4 MiB message
// limit, and the reconciler fails on every run; CSI requires a driver with LIST_VOLUMES to
// honour max_entries.
const listPage = 1000

// listPublished pages through ListVolumes (--max-entries per page, else listPage) and
// returns the nodes each volume is published to.
func (c *Controller) listPublished(ctx context.Context) (map[string][]string, error) {
	published := map[string][]string{}
	page := int32(c.maxEntries)
	if page == 0 {
		page = listPage
	}
	token := ""
	for {
		rsp, err := c.csi.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: page, StartingToken: token})
		if err != nil {
			return nil, fmt.Errorf("failed to list volumes: %w", err)
		}
		for _, e := range rsp.GetEntries() {
			published[e.GetVolume().GetVolumeId()] = e.GetStatus().GetPublishedNodeIds()
		}
		if token = rsp.GetNextToken(); token == "" {
			return published, nil
		}
	}
}
