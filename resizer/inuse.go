package resizer

import (
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
)

// inUseTracker serves drivers that expand only offline: when the driver refuses a PVC with
// FailedPrecondition, the PVC is not tried again while a Pod uses it, and is enqueued as
// soon as the last such Pod ends or goes away (--handle-volume-inuse-error). Only then is
// the Pod informer registered, as upstream does.
type inUseTracker struct {
	pods    corelisters.PodLister
	enqueue func(key string)

	mu sync.Mutex
	// failed holds the PVC keys refused as in use, each with the resourceVersion of the PVC
	// last reported as waiting for its Pods ("" before any).
	failed map[string]string
}

func newInUseTracker(pods corelisters.PodLister, enqueue func(string)) *inUseTracker {
	return &inUseTracker{pods: pods, enqueue: enqueue, failed: map[string]string{}}
}

// handler enqueues refused PVCs of Pods that end or go away; it does nothing else.
func (t *inUseTracker) handler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(_, obj any) {
			if pod, ok := obj.(*v1.Pod); ok && podEnded(pod) {
				t.podGone(pod)
			}
		},
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if pod, ok := obj.(*v1.Pod); ok {
				t.podGone(pod)
			}
		},
	}
}

func (t *inUseTracker) podGone(pod *v1.Pod) {
	for _, claim := range claimsOf(pod) {
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
	pods, err := t.pods.Pods(pvc.Namespace).List(labels.Everything())
	if err != nil {
		return true
	}
	for _, pod := range pods {
		if podEnded(pod) {
			continue
		}
		for _, claim := range claimsOf(pod) {
			if claim == pvc.Name {
				return true
			}
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

func claimsOf(pod *v1.Pod) []string {
	var out []string
	for _, vol := range pod.Spec.Volumes {
		if vol.PersistentVolumeClaim != nil {
			out = append(out, vol.PersistentVolumeClaim.ClaimName)
		}
	}
	return out
}

func podEnded(pod *v1.Pod) bool {
	return pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed
}
