// The decision (Allows) and the Watch that feeds it from the API server.

package refgrant

import (
	"context"
	"errors"
	"fmt"
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	gatewayv1beta1 "sigs.k8s.io/gateway-api/apis/v1beta1"
	gatewayclientset "sigs.k8s.io/gateway-api/pkg/client/clientset/versioned"
	gatewaylisters "sigs.k8s.io/gateway-api/pkg/client/listers/apis/v1beta1"
)

// claimKind is the kind a grant's "from" must name: only claims refer to data sources.
const claimKind = "PersistentVolumeClaim"

// Resource is the resource the Watch reads, as RBAC and the log name it.
const Resource = "referencegrants.gateway.networking.k8s.io"

// Target is the object a claim refers to in another namespace: its namespace, API group
// ("" for the core group), kind and name.
type Target struct {
	Namespace, Group, Kind, Name string
}

func (t Target) String() string {
	if t.Group == "" {
		return t.Kind + " " + t.Namespace + "/" + t.Name
	}
	return t.Kind + "." + t.Group + " " + t.Namespace + "/" + t.Name
}

// Allows tells whether one of grants lets the claims of namespace from refer to the
// target: a grant in the target's namespace that names, in one of its "from" entries,
// PersistentVolumeClaims (core group) of namespace from and, in one of its "to"
// entries, the target's group and kind, with the target's name or no name (any object of
// the kind).
func Allows(grants []*gatewayv1beta1.ReferenceGrant, from string, to Target) bool {
	for _, g := range grants {
		if g.Namespace != to.Namespace || !fromClaimsOf(g, from) {
			continue
		}
		for _, t := range g.Spec.To {
			if string(t.Group) != to.Group || string(t.Kind) != to.Kind {
				continue
			}
			if t.Name == nil || *t.Name == "" || string(*t.Name) == to.Name {
				return true
			}
		}
	}
	return false
}

func fromClaimsOf(g *gatewayv1beta1.ReferenceGrant, namespace string) bool {
	for _, f := range g.Spec.From {
		if f.Group == "" && f.Kind == claimKind && string(f.Namespace) == namespace {
			return true
		}
	}
	return false
}

// Watch is the cache of every ReferenceGrant of the cluster. It owns its informer and
// knows why the grants cannot be read, if they cannot.
type Watch struct {
	informer cache.SharedIndexInformer
	lister   gatewaylisters.ReferenceGrantLister

	mu sync.Mutex
	// missing says what keeps the grants from being read ("" while nothing does):
	// the CRD, or the permission to list and watch them.
	missing string
	// answered: the API server has answered a list or watch of the grants, or refused it
	// for good (no CRD, no permission).
	answered bool
}

// Changed is told the namespace of every grant that appears, changes or goes: the
// claims whose data source is in that namespace may now be allowed, or no longer.
type Changed func(namespace string)

// New makes the watch of the grants of client's cluster and registers changed; Start runs
// it. transform, if not nil, is applied to the cached grants (the core's cache transform).
func New(client gatewayclientset.Interface, transform cache.TransformFunc, changed Changed) (*Watch, error) {
	w := &Watch{}
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, options metav1.ListOptions) (runtime.Object, error) {
			list, err := client.GatewayV1beta1().ReferenceGrants(metav1.NamespaceAll).List(ctx, options)
			w.heard(klog.FromContext(ctx), err)
			return list, err
		},
		WatchFuncWithContext: func(ctx context.Context, options metav1.ListOptions) (watch.Interface, error) {
			watcher, err := client.GatewayV1beta1().ReferenceGrants(metav1.NamespaceAll).Watch(ctx, options)
			w.heard(klog.FromContext(ctx), err)
			return watcher, err
		},
	}
	w.informer = cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, client), &gatewayv1beta1.ReferenceGrant{}, 0,
		cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	w.lister = gatewaylisters.NewReferenceGrantLister(w.informer.GetIndexer())
	if transform != nil {
		if err := w.informer.SetTransform(transform); err != nil {
			return nil, fmt.Errorf("setting the ReferenceGrant informer's transform: %w", err)
		}
	}
	// What is missing is logged once by heard; the reflector's own report of each retry
	// would repeat it every few seconds.
	if err := w.informer.SetWatchErrorHandlerWithContext(func(ctx context.Context, r *cache.Reflector, err error) {
		if missingFor(err) != "" {
			klog.FromContext(ctx).V(4).Info("ReferenceGrants cannot be read", "err", err.Error())
			return
		}
		cache.DefaultWatchErrorHandler(ctx, r, err)
	}); err != nil {
		return nil, fmt.Errorf("setting the ReferenceGrant informer's watch error handler: %w", err)
	}
	notify := func(obj any) {
		if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		if g, ok := obj.(*gatewayv1beta1.ReferenceGrant); ok {
			changed(g.Namespace)
		}
	}
	if _, err := w.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    notify,
		UpdateFunc: func(_, obj any) { notify(obj) },
		DeleteFunc: notify,
	}); err != nil {
		return nil, err
	}
	return w, nil
}

// missingFor says what an error of a list or watch of the grants shows to be missing,
// "" for an error that passes (the API server unreachable, a watch expired).
func missingFor(err error) string {
	switch {
	case apierrors.IsNotFound(err):
		return "the API server does not serve " + Resource + "/v1beta1: install the Gateway API's ReferenceGrant CRD"
	case apierrors.IsForbidden(err):
		return "the provisioner may not list and watch " + Resource + ": grant get, list and watch on them to its service account"
	}
	return ""
}

// heard notes what a list or watch of the grants says: something missing, logged when it
// starts or stops being so.
func (w *Watch) heard(logger klog.Logger, err error) {
	missing := missingFor(err)
	if err != nil && missing == "" {
		return
	}
	w.mu.Lock()
	was := w.missing
	w.missing, w.answered = missing, true
	w.mu.Unlock()
	switch {
	case missing == was:
	case missing != "":
		logger.Error(err, "CrossNamespaceVolumeDataSource: ReferenceGrants cannot be read; claims whose data source is in another namespace are not provisioned until they can", "missing", missing)
	default:
		logger.Info("CrossNamespaceVolumeDataSource: ReferenceGrants can be read; claims whose data source is in another namespace are provisioned as their grants allow")
	}
}

// Start runs the informer until stop closes (every replica, P7).
func (w *Watch) Start(stop <-chan struct{}) { go w.informer.Run(stop) }

// Answered says whether the grants are read, or known not to be readable: the caller
// may decide on cross-namespace claims, which are refused in the second case, saying
// why. It never waits for a CRD or a permission that is missing.
func (w *Watch) Answered() bool {
	if w.informer.HasSynced() {
		return true
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.answered && w.missing != ""
}

// ErrNotGranted is the error of a reference no grant allows.
var ErrNotGranted = errors.New("no ReferenceGrant allows it")

// Check says why the claims of namespace from may not refer to the target: no grant
// allows it (ErrNotGranted), or the grants cannot be read (what is missing); nil when
// a grant allows it.
func (w *Watch) Check(from string, to Target) error {
	w.mu.Lock()
	missing := w.missing
	w.mu.Unlock()
	if missing != "" {
		return fmt.Errorf("cannot tell whether a ReferenceGrant allows it: %s", missing)
	}
	if !w.informer.HasSynced() {
		return errors.New("cannot tell whether a ReferenceGrant allows it: the ReferenceGrants are not read yet")
	}
	grants, err := w.lister.ReferenceGrants(to.Namespace).List(labels.Everything())
	if err != nil {
		return fmt.Errorf("listing the ReferenceGrants of namespace %s from the cache: %w", to.Namespace, err)
	}
	if !Allows(grants, from, to) {
		return fmt.Errorf("%w: a ReferenceGrant in namespace %s must name PersistentVolumeClaims of namespace %s in \"from\" and this %s in \"to\"", ErrNotGranted, to.Namespace, from, to.Kind)
	}
	return nil
}
