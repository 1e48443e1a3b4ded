package lifecycle

import (
	"k8s.io/client-go/tools/cache"

	"github.com/csi-sidecars/csi-sidecars/lifecycle/cached"
)

// TrimForCache is the transform of the shared informer caches (cached.Trim): it drops what
// no hosted sidecar reads, and a Pod becomes a CachedPod.
func TrimForCache(obj any) (any, error) { return cached.Trim(obj) }

// NewCacheTransform is the transform of one process's informer caches (cached.NewTransform):
// TrimForCache, and the strings and maps that many objects repeat held once.
func NewCacheTransform() cache.TransformFunc { return cached.NewTransform() }

// CachedPod is what a process's informer caches keep of a Pod (cached.Pod).
type CachedPod = cached.Pod
