// Package cached is what a leading sidecar's informer caches keep of an object: the
// transform that drops what no sidecar reads (Trim, Pod) and holds the strings and maps
// that many objects repeat once (NewTransform). Cached objects are read-only.
package cached

import (
	"slices"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/cache"
)

// Trim is the transform of the shared informer caches: it drops what no hosted
// sidecar reads, so caches of thousands of objects stay small on every replica (standbys
// keep them warm, P7). A field a sidecar decides on must never be dropped here; each
// sidecar that reads a trimmed kind tests its decisions on trimmed objects.
//
//   - Every object loses its managedFields (server-side apply bookkeeping, often the
//     larger part of an object). An update sent from a cached copy leaves them to the
//     API server, which keeps them.
//   - A Pod becomes a (cached) Pod: its identity, the claims it mounts and whether it has
//     ended, which is all the resizer's in-use check reads. No sidecar writes Pods; readers
//     of a process's Pod informer get *Pod, never *v1.Pod.
func Trim(obj any) (any, error) {
	return trimForCache(obj, nil)
}

// NewTransform is the transform of one process's informer caches: Trim, and
// the strings and maps of strings that many objects repeat shared among them (sharedValues).
func NewTransform() cache.TransformFunc {
	shared := newSharedValues()
	return func(obj any) (any, error) { return trimForCache(obj, shared) }
}

func trimForCache(obj any, table *sharedValues) (any, error) {
	if pod, ok := obj.(*v1.Pod); ok {
		obj = trimPod(pod)
	} else if m, err := meta.Accessor(obj); err == nil {
		m.SetManagedFields(nil)
	} else {
		return obj, nil // a tombstone, say: not decoded by us
	}
	internStrings(obj, table)
	return obj, nil
}

// Pod is what a process's informer caches keep of a Pod: a v1.Pod is over a
// kilobyte before its first field is set, and clusters run many more Pods than volumes.
type Pod struct {
	// ObjectMeta holds the Pod's name, namespace, UID, resourceVersion and deletion
	// timestamp only.
	metav1.ObjectMeta
	// Claims are the names of the PersistentVolumeClaims its volumes mount, in order.
	Claims []string
	// Ended is true once the Pod's phase is Succeeded or Failed.
	Ended bool
}

// GetObjectKind is that of an object with no kind: a Pod is never sent anywhere.
func (p *Pod) GetObjectKind() schema.ObjectKind { return schema.EmptyObjectKind }

// DeepCopyObject copies the Pod, as client-go's cache mutation detector does.
func (p *Pod) DeepCopyObject() runtime.Object {
	out := &Pod{Claims: slices.Clone(p.Claims), Ended: p.Ended}
	p.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	return out
}

func trimPod(pod *v1.Pod) *Pod {
	out := &Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:              pod.Name,
			Namespace:         pod.Namespace,
			UID:               pod.UID,
			ResourceVersion:   pod.ResourceVersion,
			DeletionTimestamp: pod.DeletionTimestamp,
		},
		Ended: pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed,
	}
	for _, vol := range pod.Spec.Volumes {
		if vol.PersistentVolumeClaim != nil {
			out.Claims = append(out.Claims, vol.PersistentVolumeClaim.ClaimName)
		}
	}
	return out
}
