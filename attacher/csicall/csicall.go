// Package csicall is the attacher's calls to the driver: ControllerPublishVolume and
// ControllerUnpublishVolume, each bounded by --timeout and marked for the metrics of
// migrated volumes, and ListVolumes paged through for the nodes each volume is published
// to. The connection's interceptor (csi-lib-utils) logs every call, as upstream's.
package csicall

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// ListPage is the ListVolumes page size when --max-entries is 0. Upstream then asks for
// every volume in one answer, which past some ten thousand volumes exceeds gRPC's 4 MiB
// message limit, and the reconciler fails on every run; CSI requires a driver with
// LIST_VOLUMES to honour max_entries.
const ListPage = 1000

// Driver calls one driver's controller service.
type Driver struct {
	// Client is the driver's controller service.
	Client csi.ControllerClient
	// Timeout bounds each call (--timeout), and ListPublished's pages together.
	Timeout time.Duration
	// MaxEntries is ListVolumes' page size (--max-entries); 0 is ListPage.
	MaxEntries int
}

// Publish calls ControllerPublishVolume and returns the publish context. migrated marks
// the call as one for a migrated in-tree volume.
func (d *Driver) Publish(ctx context.Context, migrated bool, req *csi.ControllerPublishVolumeRequest) (map[string]string, error) {
	ctx, cancel := context.WithTimeout(lifecycle.MarkMigrated(ctx, migrated), d.Timeout)
	defer cancel()
	rsp, err := d.Client.ControllerPublishVolume(ctx, req)
	if err != nil {
		return nil, err
	}
	return rsp.GetPublishContext(), nil
}

// Unpublish calls ControllerUnpublishVolume; migrated as for Publish.
func (d *Driver) Unpublish(ctx context.Context, migrated bool, req *csi.ControllerUnpublishVolumeRequest) error {
	ctx, cancel := context.WithTimeout(lifecycle.MarkMigrated(ctx, migrated), d.Timeout)
	defer cancel()
	_, err := d.Client.ControllerUnpublishVolume(ctx, req)
	return err
}

// ListPublished pages through ListVolumes (MaxEntries per page, else ListPage), all
// pages within Timeout, and returns by volume handle the nodes each volume is published
// to.
func (d *Driver) ListPublished(ctx context.Context) (map[string][]string, error) {
	ctx, cancel := context.WithTimeout(ctx, d.Timeout)
	defer cancel()
	published := map[string][]string{}
	page := int32(d.MaxEntries)
	if page == 0 {
		page = ListPage
	}
	token := ""
	for {
		rsp, err := d.Client.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: page, StartingToken: token})
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
