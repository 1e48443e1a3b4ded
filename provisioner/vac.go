package provisioner

import (
	"context"
	"slices"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/discovery"
	"k8s.io/component-base/featuregate"
	"k8s.io/klog/v2"
)

// defaultDiscoveryBackoff paces the retries of the VolumeAttributesClass discovery at
// start: about 15 s in all, enough for an API server that restarts, short enough for a
// start-up.
var defaultDiscoveryBackoff = wait.Backoff{Duration: time.Second, Factor: 2, Steps: 5}

// volumeAttributesClassEnabled applies the VolumeAttributesClass gate as upstream's
// cmd/csi-provisioner does: left at its default, the gate is turned off when the API server
// does not serve storage.k8s.io/v1 VolumeAttributesClass (older clusters), so that claims
// are provisioned without reading a class the API server does not have; set explicitly, it
// is obeyed. A discovery request that fails (an API server restarting, a timeout) is
// retried along backoff, where upstream asks once; when it still fails, the gate stays on,
// as upstream leaves it.
func volumeAttributesClassEnabled(ctx context.Context, gates featuregate.FeatureGate, disc discovery.DiscoveryInterface, backoff wait.Backoff) bool {
	if !gates.Enabled(VolumeAttributesClass) {
		return false
	}
	if g, ok := gates.(interface {
		ExplicitlySet(featuregate.Feature) bool
	}); ok && g.ExplicitlySet(VolumeAttributesClass) {
		return true
	}
	logger := klog.FromContext(ctx)
	var served bool
	var lastErr error
	err := wait.ExponentialBackoffWithContext(ctx, backoff, func(ctx context.Context) (bool, error) {
		list, err := discovery.ToServerResourcesInterfaceWithContext(disc).ServerResourcesForGroupVersionWithContext(ctx, "storage.k8s.io/v1")
		switch {
		case apierrors.IsNotFound(err):
			return true, nil
		case err != nil:
			lastErr = err
			logger.V(2).Info("Discovering storage.k8s.io/v1 for the VolumeAttributesClass feature gate failed, retrying", "err", err)
			return false, nil
		}
		served = slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Kind == "VolumeAttributesClass" })
		return true, nil
	})
	if err != nil {
		logger.Error(lastErr, "Cannot discover whether the API server serves storage.k8s.io/v1 VolumeAttributesClass: feature gate VolumeAttributesClass left on, as upstream")
		return true
	}
	if !served {
		logger.Info("Disabling VolumeAttributesClass feature gate because the VolumeAttributesClass v1 API is not available")
	}
	return served
}
