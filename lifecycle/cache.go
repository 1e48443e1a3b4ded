package lifecycle

import (
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
)

// TrimForCache is the transform of the shared informer caches: it drops what no hosted
// sidecar reads, so caches of thousands of objects stay small on every replica (standbys
// keep them warm, P7). A field a sidecar decides on must never be dropped here; each
// sidecar that reads a trimmed kind tests its decisions on trimmed objects.
//
//   - Every object loses its managedFields (server-side apply bookkeeping, often the
//     larger part of an object). An update sent from a cached copy leaves them to the
//     API server, which keeps them.
//   - A Pod keeps only what the resizer's in-use check reads (which claims it mounts, and
//     whether it has ended) and its identity. No sidecar writes Pods.
func TrimForCache(obj any) (any, error) {
	return trimForCache(obj, nil)
}

// NewCacheTransform is the transform of one process's informer caches: TrimForCache, and
// maps of strings that many objects repeat shared among them (sharedMaps).
func NewCacheTransform() cache.TransformFunc {
	shared := newSharedMaps()
	return func(obj any) (any, error) { return trimForCache(obj, shared) }
}

func trimForCache(obj any, maps *sharedMaps) (any, error) {
	if pod, ok := obj.(*v1.Pod); ok {
		obj = trimPod(pod)
	} else if m, err := meta.Accessor(obj); err == nil {
		m.SetManagedFields(nil)
	} else {
		return obj, nil // a tombstone, say: not decoded by us
	}
	internStrings(obj, maps)
	return obj, nil
}

func trimPod(pod *v1.Pod) *v1.Pod {
	out := &v1.Pod{
		TypeMeta: pod.TypeMeta,
		ObjectMeta: metav1.ObjectMeta{
			Name:              pod.Name,
			Namespace:         pod.Namespace,
			UID:               pod.UID,
			ResourceVersion:   pod.ResourceVersion,
			DeletionTimestamp: pod.DeletionTimestamp,
		},
		Status: v1.PodStatus{Phase: pod.Status.Phase},
	}
	for _, vol := range pod.Spec.Volumes {
		if vol.PersistentVolumeClaim != nil {
			out.Spec.Volumes = append(out.Spec.Volumes, v1.Volume{Name: vol.Name, VolumeSource: v1.VolumeSource{PersistentVolumeClaim: vol.PersistentVolumeClaim}})
		}
	}
	return out
}
