// A data source's protection: upstream's finalizer on the source claim or snapshot while a
// volume may be made from it (its own queue, and a sweep for snapshots).

package sources

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	snaplisters "github.com/kubernetes-csi/external-snapshotter/client/v8/listers/volumesnapshot/v1"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// Guard keeps the protection finalizers of data sources: it puts one on before a
// CreateVolume from the source (Protect) and takes it off once no claim of the driver
// still needs the source (Sync). It owns the source queue (keyed by request.SourceRef.Key),
// the snapshot watch and its sweep; what "still needs" means is the claim's way's to say
// (Users).
type Guard struct {
	cfg   Config
	queue *lifecycle.Queue[string]
	users Users
	// claims is the claim cache through this process's own writes of claims.
	claims  *lifecycle.OwnWrites[*v1.PersistentVolumeClaim]
	volumes corelisters.PersistentVolumeLister
	classes storagelisters.StorageClassLister
	// snapshots is nil without snapshot support.
	snapshots *snapshotWatch
}

// Config is what the guard needs from the provisioner.
type Config struct {
	// Names are the names the driver's claims, classes and PersistentVolumes may give it.
	Names request.DriverNames
	Kube  kubernetes.Interface
	// Ops is the parent of the finalizers' writes, which belong to the operation they
	// protect (P1).
	Ops context.Context
	// Timeout bounds the reads of a snapshot's content (--timeout).
	Timeout time.Duration
}

// Users names a claim of the driver whose volume is still being made from a source,
// "" for none.
type Users interface {
	SourceUser(ref request.SourceRef) string
}

// New queues sources from the claims' events (claims is the claim informer),
// and from the snapshots' when snapshotClient is not nil.
func New(cfg Config, queue *lifecycle.Queue[string], users Users, claims cache.SharedInformer, own *lifecycle.OwnWrites[*v1.PersistentVolumeClaim],
	volumes corelisters.PersistentVolumeLister, classes storagelisters.StorageClassLister, snapshotClient snapclientset.Interface) (*Guard, error) {
	g := &Guard{cfg: cfg, queue: queue, users: users, claims: own, volumes: volumes, classes: classes}
	if _, err := claims.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    g.enqueueClaimSources,
		UpdateFunc: func(_, obj any) { g.enqueueClaimSources(obj) },
		DeleteFunc: g.enqueueClaimSources,
	}); err != nil {
		return nil, err
	}
	if snapshotClient != nil {
		if err := g.watchSnapshots(snapshotClient); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// SnapshotAPIAvailable tells, by discovery, whether the VolumeSnapshot API is served.
func SnapshotAPIAvailable(d discovery.DiscoveryInterface) (bool, error) {
	resources, err := d.ServerResourcesForGroupVersion(snapshotv1.SchemeGroupVersion.String())
	if apierrors.IsNotFound(err) {
		return false, nil
	} else if err != nil {
		return false, fmt.Errorf("discovering %s: %w", snapshotv1.SchemeGroupVersion, err)
	}
	for _, r := range resources.APIResources {
		if r.Name == "volumesnapshots" {
			return true, nil
		}
	}
	return false, nil
}

// snapshotWatch is the VolumeSnapshot informer, present when the driver restores
// snapshots and the API is served.
type snapshotWatch struct {
	client   snapclientset.Interface
	informer cache.SharedIndexInformer
	lister   snaplisters.VolumeSnapshotLister
	// own reads the informer's cache through this process's own writes of snapshots.
	own *lifecycle.OwnWrites[*snapshotv1.VolumeSnapshot]
	// updateForbidden and watchForbidden warn, once each, that the RBAC lacks a verb
	// upstream's grants only from v6.2 on.
	updateForbidden *forbiddenWarning
	watchForbidden  *forbiddenWarning
}

// watchSnapshots makes the snapshot informer and registers its handler; startSnapshots
// starts it. The informer is built here rather than by the generated factory so that it
// honours a client's IsWatchListSemanticsUnSupported (the generated fake's case).
func (g *Guard) watchSnapshots(client snapclientset.Interface) error {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, options metav1.ListOptions) (runtime.Object, error) {
			return client.SnapshotV1().VolumeSnapshots(metav1.NamespaceAll).List(ctx, options)
		},
		WatchFuncWithContext: func(ctx context.Context, options metav1.ListOptions) (watch.Interface, error) {
			return client.SnapshotV1().VolumeSnapshots(metav1.NamespaceAll).Watch(ctx, options)
		},
	}
	informer := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, client), &snapshotv1.VolumeSnapshot{}, 0,
		cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	g.snapshots = &snapshotWatch{
		client: client, informer: informer, lister: snaplisters.NewVolumeSnapshotLister(informer.GetIndexer()),
		updateForbidden: &forbiddenWarning{
			permission:  "update on volumesnapshots.snapshot.storage.k8s.io",
			consequence: "volumes are restored without the source-protection finalizer, so a snapshot can be deleted while a volume is restored from it",
		},
		watchForbidden: &forbiddenWarning{
			permission:  "watch on volumesnapshots.snapshot.storage.k8s.io",
			consequence: "the snapshot cache is refreshed by relisting every snapshot, with backoff, instead of watching",
		},
	}
	own, err := lifecycle.NewOwnWrites[*snapshotv1.VolumeSnapshot](klog.Background(), informer)
	if err != nil {
		return fmt.Errorf("snapshot cache: %w", err)
	}
	g.snapshots.own = own
	// Trimmed as the core's shared caches are (managedFields dropped): a standby keeps every
	// snapshot of the cluster in memory (P7).
	if err := informer.SetTransform(lifecycle.TrimForCache); err != nil {
		return fmt.Errorf("setting the snapshot informer's transform: %w", err)
	}
	if err := informer.SetWatchErrorHandlerWithContext(g.snapshots.watchForbidden.watchErrorHandler); err != nil {
		return fmt.Errorf("setting the snapshot informer's watch error handler: %w", err)
	}
	// A snapshot that still carries our finalizer gets checked, e.g. on a new leader.
	_, err = informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    g.enqueueProtectedSnapshot,
		UpdateFunc: func(_, obj any) { g.enqueueProtectedSnapshot(obj) },
	})
	return err
}

// Start runs the snapshot informer, if there is one, until stop closes (every replica, P7).
func (g *Guard) Start(stop <-chan struct{}) {
	if g.snapshots != nil {
		go g.snapshots.informer.Run(stop)
	}
}

func (g *Guard) enqueueProtectedSnapshot(obj any) {
	if snap, ok := obj.(*snapshotv1.VolumeSnapshot); ok && slices.Contains(snap.Finalizers, request.SnapshotProtectionFinalizer) {
		g.queue.Add(request.SourceRef{Kind: request.SourceSnapshot, Namespace: snap.Namespace, Name: snap.Name}.Key())
	}
}

// enqueueClaimSources wakes the source protection a claim takes part in: the claim's own
// cloning finalizer, and the source of a claim that got its volume or goes away.
func (g *Guard) enqueueClaimSources(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	claim, ok := obj.(*v1.PersistentVolumeClaim)
	if !ok {
		return
	}
	if slices.Contains(claim.Finalizers, request.CloneProtectionFinalizer) {
		g.queue.Add(request.SourceRef{Kind: request.SourceClone, Namespace: claim.Namespace, Name: claim.Name}.Key())
	}
	if ref, err := request.ClaimSource(claim); err == nil && ref.Kind != request.SourceNone {
		g.queue.Add(ref.Key())
	}
}

// cachedClaim returns the claim from the cache through this process's own writes, nil
// when it is not there.
func cachedClaim(claims *lifecycle.OwnWrites[*v1.PersistentVolumeClaim], namespace, name string) *v1.PersistentVolumeClaim {
	claim, ok, err := claims.Get(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return claim
}

// Protect puts the protection finalizer on the plan's source before CreateVolume,
// on ctx (Ops()).
func (g *Guard) Protect(ctx context.Context, ref request.SourceRef) error {
	switch ref.Kind {
	case request.SourceClone:
		return g.setClaimFinalizer(ctx, ref, true)
	case request.SourceSnapshot:
		return g.setSnapshotFinalizer(ctx, ref, true)
	}
	return nil
}

// Sync is what happens to one protected source: once no claim of the
// driver still needs it, its finalizer goes. While one does, the key is retried with
// backoff (the claim's progress also wakes it).
func (g *Guard) Sync(key string) error {
	ref, err := parseSourceKey(key)
	if err != nil {
		klog.Background().Error(err, "Dropping a malformed source key")
		return nil
	}
	ctx := klog.NewContext(g.cfg.Ops, klog.Background().WithValues("source", ref.String()))
	// The finalizer names are shared by every provisioner of the cluster: a source of
	// another driver is its provisioner's to release, whatever this one's claims say.
	switch ref.Kind {
	case request.SourceClone:
		claim := cachedClaim(g.claims, ref.Namespace, ref.Name)
		if claim == nil || !slices.Contains(claim.Finalizers, request.CloneProtectionFinalizer) || !g.isDriverClaim(claim) {
			return nil
		}
		if user := g.users.SourceUser(ref); user != "" {
			return fmt.Errorf("%s is still the source of claim %s", ref, user)
		}
		return g.setClaimFinalizer(ctx, ref, false)
	case request.SourceSnapshot:
		if g.snapshots == nil {
			return nil
		}
		snap, err := g.snapshots.lister.VolumeSnapshots(ref.Namespace).Get(ref.Name)
		if err != nil || !slices.Contains(snap.Finalizers, request.SnapshotProtectionFinalizer) {
			return nil
		}
		// The caches first: a snapshot still in use keeps its finalizer without an API
		// read of its content on every retry.
		if user := g.users.SourceUser(ref); user != "" {
			return fmt.Errorf("%s is still the source of claim %s", ref, user)
		}
		if ours, err := g.releasableSnapshot(ctx, snap); err != nil || !ours {
			return err
		}
		return g.setSnapshotFinalizer(ctx, ref, false)
	}
	return nil
}

// isDriverClaim tells, from the caches, whether the claim's volume is the driver's: its
// PersistentVolume's CSI driver once bound, else the provisioner it names or its
// StorageClass names.
func (g *Guard) isDriverClaim(claim *v1.PersistentVolumeClaim) bool {
	var pv *v1.PersistentVolume
	if claim.Spec.VolumeName != "" {
		pv, _ = g.volumes.Get(claim.Spec.VolumeName)
	}
	var class *storagev1.StorageClass
	if name := volumehelpers.GetPersistentVolumeClaimClass(claim); name != "" {
		class, _ = g.classes.Get(name)
	}
	return claimOfDriver(claim, pv, class, g.cfg.Names)
}

// claimOfDriver decides isDriverClaim; pv and class are nil when unknown. An in-tree
// volume, provisioner or class counts when the driver replaces its plugin (CSI migration).
func claimOfDriver(claim *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, class *storagev1.StorageClass, names request.DriverNames) bool {
	switch {
	case pv != nil && pv.Spec.CSI != nil:
		return pv.Spec.CSI.Driver == names.Driver
	case pv != nil:
		return names.InTreeOfDriver(pv)
	case request.ClaimProvisioner(claim) != "":
		return names.ClaimNamesDriver(claim)
	case class != nil:
		return names.ClassOfDriver(class)
	}
	return false
}

// releasableSnapshot tells whether this provisioner may remove the protection finalizer of
// a snapshot no claim of the driver uses: its content was made by the driver, or it has no
// content (never bound, or the content is gone): nothing can be restoring from such a
// snapshot, whoever put the finalizer on, and keeping it would leave the snapshot stuck
// Terminating for good. The content is read from the API server on ctx (Ops()): there is
// no content informer, and only snapshots carrying the finalizer get here.
func (g *Guard) releasableSnapshot(ctx context.Context, snap *snapshotv1.VolumeSnapshot) (bool, error) {
	if snap.Status == nil || snap.Status.BoundVolumeSnapshotContentName == nil {
		return true, nil
	}
	ctx, cancel := context.WithTimeout(ctx, g.cfg.Timeout)
	defer cancel()
	name := *snap.Status.BoundVolumeSnapshotContentName
	content, err := g.snapshots.client.SnapshotV1().VolumeSnapshotContents().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return true, nil
	} else if err != nil {
		return false, fmt.Errorf("reading VolumeSnapshotContent %s of snapshot %s: %w", name, klog.KObj(snap), err)
	}
	return content.Spec.Driver == g.cfg.Names.Driver, nil
}

func parseSourceKey(key string) (request.SourceRef, error) {
	parts := strings.SplitN(key, "/", 3)
	if len(parts) != 3 {
		return request.SourceRef{}, fmt.Errorf("source key %q is not kind/namespace/name", key)
	}
	ref := request.SourceRef{Namespace: parts[1], Name: parts[2]}
	switch parts[0] {
	case "pvc":
		ref.Kind = request.SourceClone
	case "snapshot":
		ref.Kind = request.SourceSnapshot
	default:
		return request.SourceRef{}, fmt.Errorf("source key %q has an unknown kind", key)
	}
	return ref, nil
}

// setClaimFinalizer adds or removes the cloning finalizer of a source claim: one update of
// the freshest copy this process knows (OwnWrites), with its resource version; a conflict
// goes back to the queue, whose backoff lets the cache catch up (P14).
func (g *Guard) setClaimFinalizer(ctx context.Context, ref request.SourceRef, add bool) error {
	claim := cachedClaim(g.claims, ref.Namespace, ref.Name)
	if claim == nil {
		if add {
			return fmt.Errorf("source claim %s not found", ref)
		}
		return nil
	}
	finalizers, changed := request.WithFinalizer(claim.Finalizers, request.CloneProtectionFinalizer, add)
	if !changed {
		return nil
	}
	update := claim.DeepCopy()
	update.Finalizers = finalizers
	out, err := g.cfg.Kube.CoreV1().PersistentVolumeClaims(ref.Namespace).Update(ctx, update, metav1.UpdateOptions{})
	switch {
	case apierrors.IsNotFound(err) && !add:
		return nil
	case err != nil:
		return fmt.Errorf("setting finalizer %s on claim %s (add=%v): %w", request.CloneProtectionFinalizer, ref, add, err)
	}
	g.claims.Wrote(out)
	klog.FromContext(ctx).V(3).Info("Cloning protection changed", "claim", ref.String(), "protected", add)
	return nil
}

// setSnapshotFinalizer adds or removes the source-protection finalizer of a snapshot.
//
// Upstream's RBAC grants update on volumesnapshots only from v6.2 on. Under an older one
// the write is forbidden and, as upstream, that is no failure: the restore goes on without
// protection (add), or the finalizer stays for a sweep to retry (remove); a warning says
// so once.
func (g *Guard) setSnapshotFinalizer(ctx context.Context, ref request.SourceRef, add bool) error {
	if g.snapshots == nil {
		return nil
	}
	logger := klog.FromContext(ctx)
	snap, ok, err := g.snapshots.own.Get(ref.Namespace + "/" + ref.Name)
	switch {
	case err != nil:
		return fmt.Errorf("reading snapshot %s from the cache: %w", ref, err)
	case !ok && add:
		return fmt.Errorf("source snapshot %s not found", ref)
	case !ok:
		return nil
	}
	finalizers, changed := request.WithFinalizer(snap.Finalizers, request.SnapshotProtectionFinalizer, add)
	if !changed {
		return nil
	}
	update := snap.DeepCopy()
	update.Finalizers = finalizers
	out, err := g.snapshots.client.SnapshotV1().VolumeSnapshots(ref.Namespace).Update(ctx, update, metav1.UpdateOptions{})
	if err == nil {
		g.snapshots.own.Wrote(out)
	}
	switch {
	case apierrors.IsNotFound(err) && !add:
		return nil
	case apierrors.IsForbidden(err):
		g.snapshots.updateForbidden.report(logger, err, "snapshot", ref.String(), "protect", add)
		return nil
	case err != nil:
		return fmt.Errorf("setting finalizer %s on snapshot %s (add=%v): %w", request.SnapshotProtectionFinalizer, ref, add, err)
	}
	if changed {
		logger.V(3).Info("Snapshot source protection changed", "snapshot", ref.String(), "protected", add)
	}
	return nil
}

// Sweep checks every snapshot that carries the provisioner's finalizer, every
// interval until intake ends: a finalizer whose restore is over (a crash, a claim deleted
// meanwhile) goes.
func (g *Guard) Sweep(intake context.Context, interval time.Duration) {
	if g.snapshots == nil || interval <= 0 {
		return
	}
	wait.UntilWithContext(intake, func(context.Context) {
		for _, obj := range g.snapshots.informer.GetStore().List() {
			g.enqueueProtectedSnapshot(obj)
		}
	}, interval)
}

// Queue is the guard's queue, by source key (request.SourceRef.Key), for the workers that
// run Sync.
func (g *Guard) Queue() *lifecycle.Queue[string] { return g.queue }

// HasSynced says whether the snapshot cache, if the guard watches snapshots, is filled.
func (g *Guard) HasSynced() bool { return g.snapshots == nil || g.snapshots.informer.HasSynced() }

// SnapshotCache is the guard's cache of VolumeSnapshots, nil without snapshot support.
func (g *Guard) SnapshotCache() cache.Store {
	if g.snapshots == nil {
		return nil
	}
	return g.snapshots.informer.GetStore()
}

// WarnedOfMissingSnapshotUpdate says whether the guard has warned that the RBAC does not
// grant update on VolumeSnapshots (upstream's before v6.2).
func (g *Guard) WarnedOfMissingSnapshotUpdate() bool {
	return g.snapshots != nil && g.snapshots.updateForbidden.warned.Load()
}
