// Package cachetest gives unit tests over a fake clientset the transform of the core's
// informer caches (lifecycle.NewCacheTransform), so that sidecars' decisions are fed from
// objects as trimmed and shared as in production.
package cachetest

import (
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Transform is lifecycle.NewCacheTransform applied to a copy of each object. The fake
// clientset's watch hands out the very objects its tracker keeps (an API server's are
// decoded afresh), so transforming them in place would race the tracker's own reads.
func Transform() cache.TransformFunc {
	transform := lifecycle.NewCacheTransform()
	return func(obj any) (any, error) {
		if o, ok := obj.(runtime.Object); ok {
			obj = o.DeepCopyObject()
		}
		return transform(obj)
	}
}
