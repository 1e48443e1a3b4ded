package capacity

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// Labels of the CSIStorageCapacity objects, with upstream's names and values (P9).
const (
	capacityDriverLabel    = "csi.storage.k8s.io/drivername"
	capacityManagedByLabel = "csi.storage.k8s.io/managed-by"
	capacityManagedBy      = "external-provisioner"
	capacityGenerateName   = "csisc-"
	capacityQueueName      = "csistoragecapacity"
	// capacityKeyIndex indexes the managed objects by their key (capacityKey.String).
	capacityKeyIndex = "capacityKey"
)

// capacityKey names one CSIStorageCapacity object: a StorageClass and a topology segment
// in its canonical form (labels.Set.String: sorted key=value pairs). The zero key is the
// request to recompute the desired set.
type capacityKey struct {
	class   string
	segment string
}

var recomputeCapacities = capacityKey{}

func (k capacityKey) String() string { return k.class + "@" + k.segment }

// Client is what capacity tracking needs from the driver.
type Client interface {
	GetCapacity(ctx context.Context, in *csi.GetCapacityRequest, opts ...grpc.CallOption) (*csi.GetCapacityResponse, error)
}

// Config is what the tracker needs from the outside world; Setup fills it from the
// core's Env and the flags, tests fill it themselves.
type Config struct {
	Driver    string
	Namespace string // where the objects live
	ManagedBy string // value of the managed-by label
	Owner     *metav1.OwnerReference
	// Immediate also tracks classes with immediate binding.
	Immediate    bool
	PollInterval time.Duration
	Timeout      time.Duration
	Threads      int
	CSI          Client
	// Kube is the capacity client (its own QPS and burst).
	Kube kubernetes.Interface
	// Ops is the parent of every GetCapacity and the write that records it (P1).
	Ops context.Context
	// NodeSegment is the one segment of a node deployment; nil: segments come from the
	// CSINodes and Nodes of the cluster.
	NodeSegment  map[string]string
	QueueMetrics workqueue.MetricsProvider
	// Backlog is where the queue reports what waits for a worker (Env.Backlog).
	Backlog *lifecycle.Backlog
}

// Tracker keeps the driver's CSIStorageCapacity objects as GetCapacity says.
type Tracker struct {
	cfg Config

	classes  storagelisters.StorageClassLister
	nodes    corelisters.NodeLister       // nil in a node deployment
	csiNodes storagelisters.CSINodeLister // nil in a node deployment
	synced   []cache.InformerSynced
	// objects is the cache of the managed objects (namespace and labels filtered by the
	// server), indexed by key (capacityKeyIndex); its informer lives on its own factory,
	// started by start.
	objects      cache.Indexer
	objectsStart func(stop <-chan struct{})
	// own reads objects through this replica's own writes and creations: a sync that
	// follows a write before the informer shows it starts from what was written, and a
	// second object for the key is not created meanwhile.
	own *lifecycle.OwnWrites[*storagev1.CSIStorageCapacity]

	queue *lifecycle.Queue[capacityKey]

	mu sync.Mutex
	// desired holds the segment labels of every object that should exist.
	desired map[capacityKey]map[string]string
	// syncing holds the keys whose sync runs now, with the latest object an event
	// brought meanwhile (nil for none): the sync's own write is not a change to repair,
	// but someone else's edit it did not see is, once it has finished (the event of its
	// write may come before the write's answer is recorded, when Echo cannot know it yet).
	syncing map[capacityKey]*storagev1.CSIStorageCapacity
	// computed: desired has been computed once (before, every key looks unwanted).
	computed bool
}

// New registers the listers and handlers on the shared factory and builds
// the informer of the managed objects. It must run before the shared factory starts.
func New(cfg Config, shared informers.SharedInformerFactory, retryStart, retryMax time.Duration) (*Tracker, error) {
	t := &Tracker{cfg: cfg, desired: map[capacityKey]map[string]string{}, syncing: map[capacityKey]*storagev1.CSIStorageCapacity{}}
	t.queue = lifecycle.NewQueue[capacityKey](lifecycle.QueueOptions{Name: capacityQueueName, RetryStart: retryStart, RetryMax: retryMax,
		Metrics: cfg.QueueMetrics, Backlog: cfg.Backlog})
	recompute := func(any) { t.queue.Add(recomputeCapacities) }

	classes := shared.Storage().V1().StorageClasses()
	t.classes = classes.Lister()
	if _, err := classes.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    recompute,
		UpdateFunc: func(_, obj any) { recompute(obj) },
		DeleteFunc: recompute,
	}); err != nil {
		return nil, err
	}
	t.synced = append(t.synced, classes.Informer().HasSynced)
	if cfg.NodeSegment == nil {
		nodes := shared.Core().V1().Nodes()
		csiNodes := shared.Storage().V1().CSINodes()
		t.nodes, t.csiNodes = nodes.Lister(), csiNodes.Lister()
		if _, err := nodes.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc: recompute,
			// Nodes change all the time (status); only their labels make segments.
			UpdateFunc: func(old, obj any) {
				o, ok1 := old.(*v1.Node)
				n, ok2 := obj.(*v1.Node)
				if !ok1 || !ok2 || !maps.Equal(o.Labels, n.Labels) {
					recompute(obj)
				}
			},
			DeleteFunc: recompute,
		}); err != nil {
			return nil, err
		}
		if _, err := csiNodes.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    recompute,
			UpdateFunc: func(_, obj any) { recompute(obj) },
			DeleteFunc: recompute,
		}); err != nil {
			return nil, err
		}
		t.synced = append(t.synced, nodes.Informer().HasSynced, csiNodes.Informer().HasSynced)
	}

	// Only this instance's objects: the namespace and labels filter on the server.
	selector := labels.Set{capacityDriverLabel: cfg.Driver, capacityManagedByLabel: cfg.ManagedBy}.String()
	// Trimmed as the core's shared caches are (managedFields dropped); an update from a
	// cached copy leaves them to the API server.
	own := informers.NewSharedInformerFactoryWithOptions(cfg.Kube, 0, informers.WithNamespace(cfg.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = selector }),
		informers.WithTransform(lifecycle.TrimForCache))
	objects := own.Storage().V1().CSIStorageCapacities().Informer()
	if err := objects.AddIndexers(cache.Indexers{capacityKeyIndex: t.indexByKey}); err != nil {
		return nil, fmt.Errorf("indexing CSIStorageCapacity objects: %w", err)
	}
	t.objects = objects.GetIndexer()
	// Only a change by someone else, an object no longer wanted or a duplicate, or the
	// deletion of an object, asks for a sync: the events of this replica's own writes do
	// not (each would cost a GetCapacity and, with a drifting answer, another write). The
	// handler gets them through OwnWrites, so a sync that an event asks for reads the
	// objects as that event left them.
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { t.onObject(nil, obj) },
		UpdateFunc: t.onObject,
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			// Our labels may be gone from it: the key is what counts.
			if sc, ok := obj.(*storagev1.CSIStorageCapacity); ok && sc.Namespace == t.cfg.Namespace {
				t.queue.Add(keyOfCapacity(sc))
			}
		},
	}
	var err error
	if t.own, err = lifecycle.NewOwnCreations[*storagev1.CSIStorageCapacity](klog.Background(), objects, handler); err != nil {
		return nil, fmt.Errorf("CSIStorageCapacity cache: %w", err)
	}
	t.synced = append(t.synced, objects.HasSynced)
	t.objectsStart = own.Start
	return t, nil
}

// indexByKey indexes a managed object by its key (capacityKeyIndex).
func (t *Tracker) indexByKey(obj any) ([]string, error) {
	if sc, ok := obj.(*storagev1.CSIStorageCapacity); ok && t.manages(sc) {
		return []string{keyOfCapacity(sc).String()}, nil
	}
	return nil, nil
}

// onObject enqueues the key of an added (old nil) or updated object when it needs a sync:
// an object that lost our labels, one the desired set does not want, a second object for
// its key, or one whose values someone else changed. The events of this replica's own
// writes ask for nothing (OwnWrites.Echo): with a driver whose answer drifts, each would
// cost a GetCapacity and another write, a stream of them.
func (t *Tracker) onObject(old, obj any) {
	sc, ok := obj.(*storagev1.CSIStorageCapacity)
	if !ok || sc.Namespace != t.cfg.Namespace {
		return
	}
	key := keyOfCapacity(sc)
	if !t.manages(sc) {
		// No longer ours (labels removed): the key needs an object of ours again.
		if old != nil {
			t.queue.Add(key)
		}
		return
	}
	t.mu.Lock()
	_, wanted := t.desired[key]
	unknown := !t.computed
	_, syncing := t.syncing[key]
	if syncing {
		// One handler gets the events in order: the latest is the newest.
		t.syncing[key] = sc
	}
	t.mu.Unlock()
	before, updated := old.(*storagev1.CSIStorageCapacity)
	switch {
	case unknown || !wanted || t.duplicate(sc):
		t.queue.Add(key)
	case !updated || syncing:
		// A new object of a wanted key is adopted by the next poll; the sync running
		// now tells its own write from this one when it ends (syncDone).
	case t.own.Echo(sc):
		// The event of a write of this replica.
	case changedByOthers(sc, before, t.cfg.Owner):
		t.queue.Add(key)
	}
}

// duplicate tells whether the cache holds another managed object of sc's key.
func (t *Tracker) duplicate(sc *storagev1.CSIStorageCapacity) bool {
	objs, err := t.objects.ByIndex(capacityKeyIndex, keyOfCapacity(sc).String())
	if err != nil {
		return false
	}
	return slices.ContainsFunc(objs, func(obj any) bool {
		o, ok := obj.(*storagev1.CSIStorageCapacity)
		return ok && o.UID != sc.UID
	})
}

// changedByOthers decides whether obj, a version of an object someone else wrote (not
// the echo of this replica's write), lacks what the tracker keeps in it as before held
// it: before's capacity and maximum size, and this instance's owner reference. Other
// changes (labels of others, annotations) are not the tracker's to repair.
func changedByOthers(obj, before *storagev1.CSIStorageCapacity, owner *metav1.OwnerReference) bool {
	want := &storagev1.CSIStorageCapacity{Capacity: before.Capacity, MaximumVolumeSize: before.MaximumVolumeSize}
	if owner != nil {
		want.OwnerReferences = []metav1.OwnerReference{*owner}
	}
	return !capacityUpToDate(obj, want)
}

// Refresh enqueues the keys of the class whose segment a volume of the given topology
// lies in (every key of the class for no topology): the controller made or deleted a
// volume there (capacityRefresher). It only enqueues; after intake ends RunWorkers drops
// the keys.
func (t *Tracker) Refresh(class string, topology []*csi.Topology) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, segment := range t.desired {
		if k.class == class && inSegment(segment, topology) {
			t.queue.Add(k)
		}
	}
}

// inSegment tells whether a volume accessible from topology (every segment when empty)
// lies in the segment: one of its topologies has the segment's values.
func inSegment(segment map[string]string, topology []*csi.Topology) bool {
	if len(topology) == 0 {
		return true
	}
	return slices.ContainsFunc(topology, func(tp *csi.Topology) bool {
		for k, v := range segment {
			if tp.GetSegments()[k] != v {
				return false
			}
		}
		return true
	})
}

// Start starts the informer of the managed objects until stop closes (every replica, so a
// standby's cache is warm, P7).
func (t *Tracker) Start(stop <-chan struct{}) { t.objectsStart(stop) }

// Run works the queue and polls until intake ends, then returns once the sync in flight
// (its GetCapacity and its write, on Ops(), P1) has finished.
func (t *Tracker) Run(intake context.Context) {
	logger := klog.FromContext(intake)
	if !cache.WaitForCacheSync(intake.Done(), t.synced...) {
		t.queue.ShutDown()
		return
	}
	logger.Info("Starting storage capacity tracking", "namespace", t.cfg.Namespace, "managedBy", t.cfg.ManagedBy, "pollInterval", t.cfg.PollInterval)
	var wg sync.WaitGroup
	wg.Go(func() {
		if t.cfg.PollInterval <= 0 {
			t.poll() // once; then only changes refresh capacity
			return
		}
		wait.UntilWithContext(intake, func(context.Context) { t.poll() }, t.cfg.PollInterval)
	})
	lifecycle.RunWorkers(intake, t.queue, t.cfg.Threads, t.sync)
	wg.Wait()
	logger.Info("Storage capacity tracking stopped")
}

// poll asks for every object again: capacity changes without any event.
func (t *Tracker) poll() {
	t.queue.Add(recomputeCapacities)
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range t.desired {
		t.queue.Add(k)
	}
}

func (t *Tracker) sync(key capacityKey) error {
	if key == recomputeCapacities {
		return t.recompute()
	}
	return t.syncObject(key)
}

// recompute derives the desired objects from the listers and enqueues what changed: new
// keys, keys no longer wanted, and objects that match no wanted key.
func (t *Tracker) recompute() error {
	classes, err := t.classes.List(labels.Everything())
	if err != nil {
		return err
	}
	segments := []map[string]string{t.cfg.NodeSegment}
	if t.cfg.NodeSegment == nil {
		csiNodes, err := t.csiNodes.List(labels.Everything())
		if err != nil {
			return err
		}
		nodes, err := t.nodes.List(labels.Everything())
		if err != nil {
			return err
		}
		segments = driverSegments(t.cfg.Driver, csiNodes, nodes)
	}
	desired := desiredCapacities(t.cfg.Driver, t.cfg.Immediate, classes, segments)
	t.mu.Lock()
	old := t.desired
	t.desired = desired
	t.computed = true
	t.mu.Unlock()
	for k := range desired {
		if _, ok := old[k]; !ok {
			t.queue.Add(k)
		}
	}
	for k := range old {
		if _, ok := desired[k]; !ok {
			t.queue.Add(k)
		}
	}
	for _, obj := range t.objects.List() {
		if sc, ok := obj.(*storagev1.CSIStorageCapacity); ok && t.manages(sc) {
			if _, ok := desired[keyOfCapacity(sc)]; !ok {
				t.queue.Add(keyOfCapacity(sc))
			}
		}
	}
	return nil
}

// syncObject makes the objects of one key what they should be: none when the key is not
// wanted, else exactly one holding what GetCapacity says now. It writes from the objects
// as this replica knows them (objectsOf), never from a read made for the write: a conflict
// is returned, and the key goes back to the queue.
func (t *Tracker) syncObject(key capacityKey) (err error) {
	logger := klog.Background().WithValues("storageClass", key.class, "segment", key.segment)
	ctx := klog.NewContext(t.cfg.Ops, logger)
	t.mu.Lock()
	computed := t.computed
	t.mu.Unlock()
	if !computed {
		// Events of the objects came before the first recompute: none is unwanted yet.
		if err := t.recompute(); err != nil {
			return err
		}
	}
	t.mu.Lock()
	segment, wanted := t.desired[key]
	t.syncing[key] = nil
	t.mu.Unlock()
	// want is what the sync wrote or found in place; nil when it did not get so far.
	var want *storagev1.CSIStorageCapacity
	defer func() { t.syncDone(key, want, err) }()
	existing, err := t.objectsOf(key)
	if err != nil {
		return err
	}
	if !wanted {
		return t.deleteObjects(ctx, existing)
	}
	class, err := t.classes.Get(key.class)
	if apierrors.IsNotFound(err) {
		// Gone since: the recompute its deletion queued removes the key.
		return nil
	} else if err != nil {
		return err
	}

	// P1: the call and the write that records it run on Ops(), so a poll in flight when
	// intake ends still lands. Only the driver call has --timeout: a write waiting for a
	// token of the budget is not abandoned (and sent again later, spending another).
	callCtx, cancel := context.WithTimeout(ctx, t.cfg.Timeout)
	resp, err := t.cfg.CSI.GetCapacity(callCtx, getCapacityRequest(class, segment))
	cancel()
	if err != nil {
		return fmt.Errorf("GetCapacity for StorageClass %s in segment %q: %w", key.class, key.segment, err)
	}
	answer := t.capacityObject(key, segment, resp)

	create := true
	if len(existing) > 0 {
		var current *storagev1.CSIStorageCapacity
		current, existing = existing[0], existing[1:]
		err := t.update(ctx, current, answer)
		switch {
		case apierrors.IsNotFound(err):
			// Deleted by someone else, perhaps before the informer showed it: the
			// object is still wanted, so it comes back.
			t.own.Gone(current)
		case err != nil:
			return err
		default:
			create = false
		}
	}
	if create {
		saved, err := t.cfg.Kube.StorageV1().CSIStorageCapacities(t.cfg.Namespace).Create(ctx, answer, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("creating CSIStorageCapacity for StorageClass %s in segment %q: %w", key.class, key.segment, err)
		}
		t.own.Wrote(saved)
		logger.V(3).Info("CSIStorageCapacity created", "name", saved.Name, "capacity", answer.Capacity)
	}
	want = answer
	// Duplicates (two replicas, or a lost create response) go.
	return t.deleteObjects(ctx, existing)
}

// syncDone ends the sync of key: an event that came meanwhile and is neither the echo of
// this replica's write nor holding what the sync wrote (want; nil: it wrote nothing) was
// someone else's change, made after the sync read the object, and asks for another sync.
// A failed sync goes back to the queue with its backoff anyway.
func (t *Tracker) syncDone(key capacityKey, want *storagev1.CSIStorageCapacity, err error) {
	t.mu.Lock()
	seen := t.syncing[key]
	delete(t.syncing, key)
	t.mu.Unlock()
	if err != nil || seen == nil || t.own.Echo(seen) {
		return
	}
	if want == nil || changedByOthers(seen, want, t.cfg.Owner) {
		t.queue.Add(key)
	}
}

// update brings current, the freshest copy of the object this replica knows, to want's
// values when they differ: one update carrying current's resourceVersion, whose answer
// goes to OwnWrites. A conflict (someone else wrote the object since) is returned: the
// key goes back to the queue, whose backoff lets the cache catch up.
func (t *Tracker) update(ctx context.Context, current, want *storagev1.CSIStorageCapacity) error {
	if capacityUpToDate(current, want) {
		return nil
	}
	update := current.DeepCopy()
	update.Capacity, update.MaximumVolumeSize = want.Capacity, want.MaximumVolumeSize
	if len(want.OwnerReferences) > 0 && !slices.ContainsFunc(update.OwnerReferences, func(r metav1.OwnerReference) bool { return r.UID == want.OwnerReferences[0].UID }) {
		update.OwnerReferences = append(update.OwnerReferences, want.OwnerReferences[0])
	}
	saved, err := t.cfg.Kube.StorageV1().CSIStorageCapacities(current.Namespace).Update(ctx, update, metav1.UpdateOptions{})
	if err != nil {
		return fmt.Errorf("updating CSIStorageCapacity %s: %w", klog.KObj(current), err)
	}
	t.own.Wrote(saved)
	klog.FromContext(ctx).V(3).Info("CSIStorageCapacity updated", "name", saved.Name, "capacity", saved.Capacity)
	return nil
}

// deleteObjects deletes objects of a key, on Ops(), and tells OwnWrites they are gone.
func (t *Tracker) deleteObjects(ctx context.Context, objs []*storagev1.CSIStorageCapacity) error {
	for _, obj := range objs {
		err := t.cfg.Kube.StorageV1().CSIStorageCapacities(obj.Namespace).Delete(ctx, obj.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &obj.UID}})
		// A conflict: the name holds another object, this one is gone.
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return fmt.Errorf("deleting CSIStorageCapacity %s: %w", klog.KObj(obj), err)
		}
		t.own.Gone(obj)
		klog.FromContext(ctx).V(3).Info("CSIStorageCapacity deleted", "name", obj.Name)
	}
	return nil
}

// objectsOf returns the managed objects of a key as this replica knows them, the cache
// read through its own writes and creations (OwnWrites): an object it created or updated
// a moment ago counts as written before the informer shows it. The oldest comes first
// (then by name): the one every replica keeps when there are several.
func (t *Tracker) objectsOf(key capacityKey) ([]*storagev1.CSIStorageCapacity, error) {
	objs, err := t.own.ByIndex(capacityKeyIndex, key.String())
	if err != nil {
		return nil, fmt.Errorf("reading the CSIStorageCapacity objects of %s: %w", key, err)
	}
	objs = slices.DeleteFunc(objs, func(sc *storagev1.CSIStorageCapacity) bool { return !t.manages(sc) || keyOfCapacity(sc) != key })
	slices.SortFunc(objs, func(a, b *storagev1.CSIStorageCapacity) int {
		if c := a.CreationTimestamp.Compare(b.CreationTimestamp.Time); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	return objs, nil
}

func (t *Tracker) manages(sc *storagev1.CSIStorageCapacity) bool {
	return sc.Namespace == t.cfg.Namespace && sc.Labels[capacityDriverLabel] == t.cfg.Driver && sc.Labels[capacityManagedByLabel] == t.cfg.ManagedBy
}

// capacityObject is the object GetCapacity's answer asks for.
func (t *Tracker) capacityObject(key capacityKey, segment map[string]string, resp *csi.GetCapacityResponse) *storagev1.CSIStorageCapacity {
	obj := &storagev1.CSIStorageCapacity{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: capacityGenerateName,
			Namespace:    t.cfg.Namespace,
			Labels:       map[string]string{capacityDriverLabel: t.cfg.Driver, capacityManagedByLabel: t.cfg.ManagedBy},
		},
		StorageClassName: key.class,
		NodeTopology:     &metav1.LabelSelector{MatchLabels: maps.Clone(segment)},
		Capacity:         resource.NewQuantity(resp.GetAvailableCapacity(), resource.BinarySI),
	}
	// CSIStorageCapacity has no field for minimum_volume_size: upstream drops it too.
	if m := resp.GetMaximumVolumeSize(); m != nil {
		obj.MaximumVolumeSize = resource.NewQuantity(m.GetValue(), resource.BinarySI)
	}
	if t.cfg.Owner != nil {
		obj.OwnerReferences = []metav1.OwnerReference{*t.cfg.Owner}
	}
	return obj
}

// getCapacityRequest asks for the class's capacity in the segment, as upstream's capacity
// controller asks: the class's parameters as they are, and no volume capabilities (the
// spec makes them optional; capacity is assumed not to depend on them). A placeholder
// capability would have to name an access mode, and UNKNOWN is one a driver may refuse.
func getCapacityRequest(class *storagev1.StorageClass, segment map[string]string) *csi.GetCapacityRequest {
	req := &csi.GetCapacityRequest{Parameters: class.Parameters}
	if len(segment) > 0 {
		req.AccessibleTopology = &csi.Topology{Segments: maps.Clone(segment)}
	}
	return req
}

// capacityUpToDate tells whether an object already holds what want says.
func capacityUpToDate(have, want *storagev1.CSIStorageCapacity) bool {
	sameQuantity := func(a, b *resource.Quantity) bool {
		if a == nil || b == nil {
			return a == b
		}
		return a.Cmp(*b) == 0
	}
	if !sameQuantity(have.Capacity, want.Capacity) || !sameQuantity(have.MaximumVolumeSize, want.MaximumVolumeSize) {
		return false
	}
	for _, o := range want.OwnerReferences {
		if !slices.ContainsFunc(have.OwnerReferences, func(r metav1.OwnerReference) bool { return r.UID == o.UID }) {
			return false
		}
	}
	return true
}

// keyOfCapacity is the key an existing object stands for. An object whose topology is not
// a plain label map gets a key no desired object has: it is obsolete.
func keyOfCapacity(sc *storagev1.CSIStorageCapacity) capacityKey {
	segment := ""
	if sc.NodeTopology != nil {
		segment = labels.Set(sc.NodeTopology.MatchLabels).String()
		if len(sc.NodeTopology.MatchExpressions) > 0 {
			segment += ";expressions"
		}
	}
	return capacityKey{class: sc.StorageClassName, segment: segment}
}

// driverSegments are the driver's topology segments: for every CSINode on which the
// driver is registered, its topology keys with the values of the Node's labels. A node
// whose labels lack a key is skipped until the labels arrive, as upstream; a driver
// without topology keys has one segment, the empty one (every node).
func driverSegments(driver string, csiNodes []*storagev1.CSINode, nodes []*v1.Node) []map[string]string {
	byName := make(map[string]*v1.Node, len(nodes))
	for _, n := range nodes {
		byName[n.Name] = n
	}
	seen := map[string]bool{}
	var out []map[string]string
	for _, csiNode := range csiNodes {
		i := slices.IndexFunc(csiNode.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == driver })
		node := byName[csiNode.Name]
		if i < 0 || node == nil {
			continue
		}
		segment := map[string]string{}
		complete := true
		for _, k := range csiNode.Spec.Drivers[i].TopologyKeys {
			v, ok := node.Labels[k]
			if !ok {
				complete = false
				break
			}
			segment[k] = v
		}
		if id := labels.Set(segment).String(); complete && !seen[id] {
			seen[id] = true
			out = append(out, segment)
		}
	}
	return out
}

// desiredCapacities are the objects that should exist: every segment for every class of
// the driver, classes with immediate binding only when asked (the scheduler uses capacity
// for WaitForFirstConsumer only).
func desiredCapacities(driver string, immediate bool, classes []*storagev1.StorageClass, segments []map[string]string) map[capacityKey]map[string]string {
	out := map[capacityKey]map[string]string{}
	for _, class := range classes {
		if class.Provisioner != driver || (!immediate && !request.WaitsForFirstConsumer(class)) {
			continue
		}
		for _, s := range segments {
			out[capacityKey{class: class.Name, segment: labels.Set(s).String()}] = s
		}
	}
	return out
}

// counts are the figures of the capacity metrics: objects that should exist, those of them
// that do, and managed objects that exist but should not.
func (t *Tracker) counts() (goal, current, obsolete int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	have := map[capacityKey]bool{}
	for _, obj := range t.objects.List() {
		if sc, ok := obj.(*storagev1.CSIStorageCapacity); ok && t.manages(sc) {
			k := keyOfCapacity(sc)
			if _, wanted := t.desired[k]; wanted {
				have[k] = true
			} else {
				obsolete++
			}
		}
	}
	return len(t.desired), len(have), obsolete
}
