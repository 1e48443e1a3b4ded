package lifecycle

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

// DiscoveryBackoff paces the retries of a discovery request at start: about 15 s in all,
// enough for an API server that restarts, short enough for a start-up.
func DiscoveryBackoff() wait.Backoff {
	return wait.Backoff{Duration: time.Second, Factor: 2, Steps: 5}
}

// GateServed applies a feature gate that needs an API (for example VolumeAttributesClass
// and storage.k8s.io/v1 volumeattributesclasses) as upstream's sidecars do: set explicitly,
// the gate is obeyed; left at its default, it is turned off when the API server does not
// serve resource in groupVersion (older clusters), so the sidecar still starts there. A
// discovery request that fails (an API server restarting, a timeout) is retried along
// backoff, where upstream asks once; when it still fails, the gate stays on, as upstream
// leaves it after logging the error.
func GateServed(ctx context.Context, gates featuregate.FeatureGate, feature featuregate.Feature, disc discovery.DiscoveryInterface, groupVersion, resource string, backoff wait.Backoff) bool {
	if !gates.Enabled(feature) {
		return false
	}
	if g, ok := gates.(interface {
		ExplicitlySet(featuregate.Feature) bool
	}); ok && g.ExplicitlySet(feature) {
		return true
	}
	logger := klog.FromContext(ctx)
	var served, found bool
	var lastErr error
	err := wait.ExponentialBackoffWithContext(ctx, backoff, func(ctx context.Context) (bool, error) {
		list, err := discovery.ToServerResourcesInterfaceWithContext(disc).ServerResourcesForGroupVersionWithContext(ctx, groupVersion)
		switch {
		case apierrors.IsNotFound(err):
			return true, nil
		case err != nil:
			lastErr = err
			logger.V(2).Info("Discovery for a feature gate failed, retrying", "gate", feature, "groupVersion", groupVersion, "err", err)
			return false, nil
		}
		found = true
		served = slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Name == resource })
		return true, nil
	})
	if err != nil {
		logger.Error(lastErr, "Cannot discover whether the API server serves the API of a feature gate: left on, as upstream", "gate", feature, "groupVersion", groupVersion, "resource", resource)
		return true
	}
	if !served {
		what := groupVersion + " " + resource
		if !found {
			what = groupVersion
		}
		logger.Info("The API server does not serve "+what+": feature gate turned off", "gate", feature)
	}
	return served
}
