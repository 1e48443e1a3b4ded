package kubelet

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// Absence is an interval during which a driver was missing from a node's CSINode; To is
// zero while it still is.
type Absence struct{ From, To time.Time }

// Presence follows one driver in a node's CSINode through a watch: whether it is listed
// now, and each interval it was not since it was first seen. Its methods are safe for
// concurrent use.
type Presence struct {
	mu       sync.Mutex
	present  bool
	seen     bool // present at least once
	absences []Absence
}

// WatchDriver watches node's CSINode for driver until ctx ends; it returns once the watch
// has its first list, which counts as the first observation.
func WatchDriver(ctx context.Context, client kubernetes.Interface, node, driver string) (*Presence, error) {
	p := &Presence{}
	lw := cache.NewFilteredListWatchFromClient(client.StorageV1().RESTClient(), "csinodes", metav1.NamespaceAll, func(o *metav1.ListOptions) {
		o.FieldSelector = "metadata.name=" + node
	})
	inf := cache.NewSharedIndexInformer(lw, &storagev1.CSINode{}, 0, cache.Indexers{})
	observe := func(obj any) {
		n, ok := obj.(*storagev1.CSINode)
		p.observe(ok && hasDriver(n, driver), time.Now())
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    observe,
		UpdateFunc: func(_, obj any) { observe(obj) },
		DeleteFunc: func(any) { p.observe(false, time.Now()) },
	}); err != nil {
		return nil, fmt.Errorf("CSINode %s: %w", node, err)
	}
	go inf.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return nil, errors.New("CSINode " + node + ": the watch did not sync")
	}
	return p, nil
}

func hasDriver(n *storagev1.CSINode, driver string) bool {
	return slices.ContainsFunc(n.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == driver })
}

func (p *Presence) observe(present bool, at time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if present == p.present {
		return
	}
	p.present = present
	switch {
	case present && p.seen:
		p.absences[len(p.absences)-1].To = at
	case present:
		p.seen = true
	default:
		p.absences = append(p.absences, Absence{From: at})
	}
}

// IsPresent says whether the driver is in CSINode now.
func (p *Presence) IsPresent() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.present
}

// Absences are the absences since the driver was first seen, one still running ending at
// end.
func (p *Presence) Absences(end time.Time) []Absence {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := slices.Clone(p.absences)
	if n := len(out); n > 0 && out[n-1].To.IsZero() {
		out[n-1].To = end
	}
	return out
}

// Absent is how long the absences lasted in all.
func Absent(absences []Absence) time.Duration {
	var d time.Duration
	for _, a := range absences {
		d += a.To.Sub(a.From)
	}
	return d
}
