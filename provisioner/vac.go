package provisioner

import (
	"context"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/discovery"
	"k8s.io/component-base/featuregate"
)

// volumeAttributesClassEnabled applies the VolumeAttributesClass gate as upstream's
// cmd/csi-provisioner does: off where the API server does not serve storage.k8s.io/v1
// VolumeAttributesClass, so claims are provisioned without reading a class the API server
// does not have; set explicitly, it is obeyed.
func volumeAttributesClassEnabled(ctx context.Context, gates featuregate.FeatureGate, disc discovery.DiscoveryInterface, backoff wait.Backoff) bool {
	return lifecycle.GateServed(ctx, gates, VolumeAttributesClass, disc, "storage.k8s.io/v1", "volumeattributesclasses", backoff)
}
