// Package cachetest gives unit tests over a fake clientset the transform of the core's
// informer caches (lifecycle.NewCacheTransform), so that sidecars' decisions are fed from
// objects as trimmed and shared as in production.
package cachetest

import (
	"testing"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
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

// CopyingWatches has cs's watches hand out copies of the objects its tracker keeps. A
// watch opened with list options (as informers open theirs) first delivers the tracker's
// stored objects as they are; an informer of a sidecar's own, whose transform edits objects
// in place as the core's caches do (lifecycle.TrimForCache), would then race the tracker's
// reads of them, a race an API server's freshly decoded objects never have.
// (Transform copies for a factory's informers; this is for informers a sidecar builds on
// the clientset itself, such as the provisioner's record events.)
func CopyingWatches(cs *fake.Clientset) {
	cs.PrependWatchReactor("*", func(action k8stesting.Action) (bool, watch.Interface, error) {
		var opts []metav1.ListOptions
		if w, ok := action.(k8stesting.WatchActionImpl); ok {
			opts = append(opts, w.ListOptions)
		}
		w, err := cs.Tracker().Watch(action.GetResource(), action.GetNamespace(), opts...)
		if err != nil {
			return true, nil, err
		}
		return true, watch.Filter(w, func(e watch.Event) (watch.Event, bool) {
			if e.Object != nil {
				e.Object = e.Object.DeepCopyObject()
			}
			return e, true
		}), nil
	})
}

// Managed gives obj the server-side apply bookkeeping (managedFields) an API server keeps
// on objects, which the caches drop.
func Managed[T metav1.Object](obj T) T {
	obj.SetManagedFields([]metav1.ManagedFieldsEntry{{Manager: "kubectl", Operation: metav1.ManagedFieldsOperationApply, APIVersion: "v1",
		FieldsType: "FieldsV1", FieldsV1: &metav1.FieldsV1{Raw: []byte(`{"f:metadata":{}}`)}}})
	return obj
}

// HasManagedFields says whether a cached object still holds managedFields.
func HasManagedFields(t *testing.T, obj any) bool {
	t.Helper()
	m, err := meta.Accessor(obj)
	if err != nil {
		t.Fatal(err)
	}
	return len(m.GetManagedFields()) > 0
}
