package resizer

import (
	"slices"
	"sync"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"
)

// inUseTracker serves drivers that expand only offline: when the driver refuses a PVC with
// FailedPrecondition, the PVC is not tried again while a Pod uses it, and is enqueued as
// soon as the last such Pod ends or goes away (--handle-volume-inuse-error). Only then is
// the Pod informer registered, as upstream does. The Pod cache holds
// *lifecycle.CachedPod (lifecycle.TrimForCache), not *v1.Pod.
type inUseTracker struct {
	pods    cache.Indexer
	enqueue func(key string)

	mu sync.Mutex
	// failed holds the PVC keys refused as in use, each with the resourceVersion of the PVC
	// last reported as waiting for its Pods ("" before any).
	failed map[string]string
}

func newInUseTracker(pods cache.Indexer, enqueue func(string)) *inUseTracker {
	return &inUseTracker{pods: pods, enqueue: enqueue, failed: map[string]string{}}
}

// handler enqueues refused PVCs of Pods that end or go away; it does nothing else.
func (t *inUseTracker) handler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(_, obj any) {
			if pod, ok := obj.(*lifecycle.CachedPod); ok && pod.Ended {
				t.podGone(pod)
			}
		},
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if pod, ok := obj.(*lifecycle.CachedPod); ok {
				t.podGone(pod)
			}
		},
	}
}

func (t *inUseTracker) podGone(pod *lifecycle.CachedPod) {
	for _, claim := range pod.Claims {
		key := pod.Namespace + "/" + claim
		t.mu.Lock()
		_, failed := t.failed[key]
		t.mu.Unlock()
		if failed {
			t.enqueue(key)
		}
	}
}

// record notes that the driver refused the PVC because it is in use.
func (t *inUseTracker) record(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.failed[key] = ""
}

// forget drops the refusal: before a new attempt (the driver will refuse again if it must)
// and when the PVC is gone.
func (t *inUseTracker) forget(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.failed, key)
}

// blocked tells whether the PVC was refused as in use and a running Pod still uses it.
func (t *inUseTracker) blocked(pvc *v1.PersistentVolumeClaim) bool {
	t.mu.Lock()
	_, failed := t.failed[pvc.Namespace+"/"+pvc.Name]
	t.mu.Unlock()
	if !failed {
		return false
	}
	pods, err := t.pods.ByIndex(cache.NamespaceIndex, pvc.Namespace)
	if err != nil {
		return true
	}
	for _, obj := range pods {
		if pod, ok := obj.(*lifecycle.CachedPod); ok && !pod.Ended && slices.Contains(pod.Claims, pvc.Name) {
			return true
		}
	}
	return false
}

// news tells whether the blocked pvc is a version not yet reported as waiting, and notes
// it as reported: a resync of the same version has nothing new to tell the user.
func (t *inUseTracker) news(pvc *v1.PersistentVolumeClaim) bool {
	key := pvc.Namespace + "/" + pvc.Name
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.failed[key] == pvc.ResourceVersion {
		return false
	}
	t.failed[key] = pvc.ResourceVersion
	return true
}
