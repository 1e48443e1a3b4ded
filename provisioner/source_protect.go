// A data source's protection: upstream's finalizer on the source claim or snapshot while a
// volume may be made from it (its own queue, and a sweep for snapshots).

package provisioner

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
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
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// Data sources: a clone or a restore protects its source with a finalizer from before
// CreateVolume until no claim of the driver still needs it (the source-protection queue,
// --cloning-protection-threads workers). The finalizers are added and removed on Ops():
// they belong to the operation they protect (P1). A stopping leader may leave a finalizer
// behind; the next leader finds it in its caches (claims on add, snapshots by the orphan
// sweep) and removes it once the source is free.
//
// Unlike upstream, which removes the cloning finalizer only once the source claim is being
// deleted, the finalizer goes as soon as no clone is in progress: it then says what it
// means, a clone is being made.

// snapshotAPIAvailable tells, by discovery, whether the VolumeSnapshot API is served.
func snapshotAPIAvailable(d discovery.DiscoveryInterface) (bool, error) {
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
func (c *controller) watchSnapshots(client snapclientset.Interface) error {
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
	c.snapshots = &snapshotWatch{
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
	c.snapshots.own = own
	// Trimmed as the core's shared caches are (managedFields dropped): a standby keeps every
	// snapshot of the cluster in memory (P7).
	if err := informer.SetTransform(lifecycle.TrimForCache); err != nil {
		return fmt.Errorf("setting the snapshot informer's transform: %w", err)
	}
	if err := informer.SetWatchErrorHandlerWithContext(c.snapshots.watchForbidden.watchErrorHandler); err != nil {
		return fmt.Errorf("setting the snapshot informer's watch error handler: %w", err)
	}
	// A snapshot that still carries our finalizer gets checked, e.g. on a new leader.
	_, err = informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueueProtectedSnapshot,
		UpdateFunc: func(_, obj any) { c.enqueueProtectedSnapshot(obj) },
	})
	return err
}

// startInformers starts the informers that are not on the core's factory, the records'
// and the snapshots', until stop closes (every replica, P7).
func (c *controller) startInformers(stop <-chan struct{}) {
	c.records.start(stop)
	if c.snapshots != nil {
		go c.snapshots.informer.Run(stop)
	}
}

func (c *controller) enqueueProtectedSnapshot(obj any) {
	if snap, ok := obj.(*snapshotv1.VolumeSnapshot); ok && slices.Contains(snap.Finalizers, snapshotProtectionFinalizer) {
		c.sourceQueue.Add(sourceRef{kind: sourceSnapshot, namespace: snap.Namespace, name: snap.Name}.key())
	}
}

// enqueueClaimSources wakes the source protection a claim takes part in: the claim's own
// cloning finalizer, and the source of a claim that got its volume or goes away.
func (c *controller) enqueueClaimSources(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	claim, ok := obj.(*v1.PersistentVolumeClaim)
	if !ok {
		return
	}
	if slices.Contains(claim.Finalizers, cloneProtectionFinalizer) {
		c.sourceQueue.Add(sourceRef{kind: sourceClone, namespace: claim.Namespace, name: claim.Name}.key())
	}
	if ref, err := claimSource(claim); err == nil && ref.kind != sourceNone {
		c.sourceQueue.Add(ref.key())
	}
}

// contentSource reads the claim's source and checks it (cloneSource, snapshotSource).
func (c *controller) contentSource(ctx context.Context, claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, ref sourceRef) (*csi.VolumeContentSource, error) {
	var (
		src *csi.VolumeContentSource
		err error
	)
	switch ref.kind {
	case sourceClone:
		source := c.claimByName(ref.namespace, ref.name)
		var sourcePV *v1.PersistentVolume
		if source != nil && source.Spec.VolumeName != "" {
			sourcePV, _ = c.volumes.Get(source.Spec.VolumeName)
		}
		src, err = cloneSource(claim, class, source, sourcePV)
	case sourceSnapshot:
		src, err = c.snapshotContentSource(ctx, claim, class, ref)
	default:
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("error getting handle for DataSource Type %s by Name %s: %w", dataSourceKind(claim), ref.name, err)
	}
	return src, nil
}

// snapshotContentSource reads the snapshot and its content from the API server (fresh:
// the snapshot controller may just have bound them) on ctx.
func (c *controller) snapshotContentSource(ctx context.Context, claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, ref sourceRef) (*csi.VolumeContentSource, error) {
	if c.snapshots == nil {
		return nil, fmt.Errorf("the %s API is not served by the cluster", snapshotv1.SchemeGroupVersion)
	}
	snap, err := c.snapshots.client.SnapshotV1().VolumeSnapshots(ref.namespace).Get(ctx, ref.name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("error getting snapshot %s from api server: %w", ref.name, err)
	}
	var content *snapshotv1.VolumeSnapshotContent
	if snap.Status != nil && snap.Status.BoundVolumeSnapshotContentName != nil {
		content, err = c.snapshots.client.SnapshotV1().VolumeSnapshotContents().Get(ctx, *snap.Status.BoundVolumeSnapshotContentName, metav1.GetOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("error getting snapshotcontent %s: %w", *snap.Status.BoundVolumeSnapshotContentName, err)
		}
		if err != nil {
			content = nil
		}
	}
	return snapshotSource(claim, class, snap, content, c.opts.preventVolumeModeConversion)
}

// claimByName returns the claim from the cache, nil when it is not there.
func (c *controller) claimByName(namespace, name string) *v1.PersistentVolumeClaim {
	claim, ok, err := c.ownClaims.Get(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return claim
}

// protectSource puts the protection finalizer on the plan's source before CreateVolume,
// on ctx (Ops()).
func (c *controller) protectSource(ctx context.Context, ref sourceRef) error {
	switch ref.kind {
	case sourceClone:
		return c.setClaimFinalizer(ctx, ref, true)
	case sourceSnapshot:
		return c.setSnapshotFinalizer(ctx, ref, true)
	}
	return nil
}

// syncSourceProtection is what happens to one protected source: once no claim of the
// driver still needs it, its finalizer goes. While one does, the key is retried with
// backoff (the claim's progress also wakes it).
func (c *controller) syncSourceProtection(key string) error {
	ref, err := parseSourceKey(key)
	if err != nil {
		klog.Background().Error(err, "Dropping a malformed source key")
		return nil
	}
	ctx := klog.NewContext(c.ops, klog.Background().WithValues("source", ref.String()))
	// The finalizer names are shared by every provisioner of the cluster: a source of
	// another driver is its provisioner's to release, whatever this one's claims say.
	switch ref.kind {
	case sourceClone:
		claim := c.claimByName(ref.namespace, ref.name)
		if claim == nil || !slices.Contains(claim.Finalizers, cloneProtectionFinalizer) || !c.isDriverClaim(claim) {
			return nil
		}
		if user := c.sourceUser(ref); user != "" {
			return fmt.Errorf("%s is still the source of claim %s", ref, user)
		}
		return c.setClaimFinalizer(ctx, ref, false)
	case sourceSnapshot:
		if c.snapshots == nil {
			return nil
		}
		snap, err := c.snapshots.lister.VolumeSnapshots(ref.namespace).Get(ref.name)
		if err != nil || !slices.Contains(snap.Finalizers, snapshotProtectionFinalizer) {
			return nil
		}
		// The caches first: a snapshot still in use keeps its finalizer without an API
		// read of its content on every retry.
		if user := c.sourceUser(ref); user != "" {
			return fmt.Errorf("%s is still the source of claim %s", ref, user)
		}
		if ours, err := c.releasableSnapshot(ctx, snap); err != nil || !ours {
			return err
		}
		return c.setSnapshotFinalizer(ctx, ref, false)
	}
	return nil
}

// isDriverClaim tells, from the caches, whether the claim's volume is the driver's: its
// PersistentVolume's CSI driver once bound, else the provisioner it names or its
// StorageClass names.
func (c *controller) isDriverClaim(claim *v1.PersistentVolumeClaim) bool {
	var pv *v1.PersistentVolume
	if claim.Spec.VolumeName != "" {
		pv, _ = c.volumes.Get(claim.Spec.VolumeName)
	}
	var class *storagev1.StorageClass
	if name := storageClassName(claim); name != "" {
		class, _ = c.classes.Get(name)
	}
	return claimOfDriver(claim, pv, class, c.names())
}

// claimOfDriver decides isDriverClaim; pv and class are nil when unknown. An in-tree
// volume, provisioner or class counts when the driver replaces its plugin (CSI migration).
func claimOfDriver(claim *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, class *storagev1.StorageClass, names driverNames) bool {
	switch {
	case pv != nil && pv.Spec.CSI != nil:
		return pv.Spec.CSI.Driver == names.driver
	case pv != nil:
		return names.inTreeOfDriver(pv)
	case claimProvisioner(claim) != "":
		return names.claimNamesDriver(claim)
	case class != nil:
		return names.classOfDriver(class)
	}
	return false
}

// releasableSnapshot tells whether this provisioner may remove the protection finalizer of
// a snapshot no claim of the driver uses: its content was made by the driver, or it has no
// content (never bound, or the content is gone): nothing can be restoring from such a
// snapshot, whoever put the finalizer on, and keeping it would leave the snapshot stuck
// Terminating for good. The content is read from the API server on ctx (Ops()): there is
// no content informer, and only snapshots carrying the finalizer get here.
func (c *controller) releasableSnapshot(ctx context.Context, snap *snapshotv1.VolumeSnapshot) (bool, error) {
	if snap.Status == nil || snap.Status.BoundVolumeSnapshotContentName == nil {
		return true, nil
	}
	ctx, cancel := context.WithTimeout(ctx, c.opts.timeout)
	defer cancel()
	name := *snap.Status.BoundVolumeSnapshotContentName
	content, err := c.snapshots.client.SnapshotV1().VolumeSnapshotContents().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return true, nil
	} else if err != nil {
		return false, fmt.Errorf("reading VolumeSnapshotContent %s of snapshot %s: %w", name, klog.KObj(snap), err)
	}
	return content.Spec.Driver == c.driver, nil
}

// sourceUser names a claim of the driver whose volume is still being made from ref: an
// operation in flight, a claim carrying a provisioning record, or a claim that names it,
// is not deleted and has no PersistentVolume yet; "" for none.
func (c *controller) sourceUser(ref sourceRef) string {
	if who := c.inFlight.using(ref); who != "" {
		return who
	}
	// A claim whose record is open (a crash, a deleted claim whose volume is being undone)
	// may have a volume in creation from the source, whatever else it says.
	if who, err := c.records.usesSource(ref); err != nil || who != "" {
		if err != nil {
			return "(records unreadable: " + err.Error() + ")"
		}
		return who
	}
	objs, err := c.claims.ByIndex(cache.NamespaceIndex, ref.namespace)
	if err != nil {
		// Keep the finalizer rather than guess.
		return "(claims unreadable: " + err.Error() + ")"
	}
	for _, obj := range objs {
		claim, ok := obj.(*v1.PersistentVolumeClaim)
		if !ok {
			continue
		}
		if src, err := claimSource(claim); err != nil || src != ref {
			continue
		}
		// The same for a record of an earlier version, on the claim.
		if rec, err := recordOf(claim); err == nil && rec != nil && rec.Driver == c.driver {
			return klog.KObj(claim).String()
		}
		if !mayNeedVolume(claim, c.names()) || claim.DeletionTimestamp != nil {
			continue
		}
		if name, err := volumeName(c.opts.volumeNamePrefix, claim.UID, c.opts.volumeNameUUIDLength); err == nil && c.pvExists(name) {
			continue
		}
		return klog.KObj(claim).String()
	}
	return ""
}

func parseSourceKey(key string) (sourceRef, error) {
	parts := strings.SplitN(key, "/", 3)
	if len(parts) != 3 {
		return sourceRef{}, fmt.Errorf("source key %q is not kind/namespace/name", key)
	}
	ref := sourceRef{namespace: parts[1], name: parts[2]}
	switch parts[0] {
	case "pvc":
		ref.kind = sourceClone
	case "snapshot":
		ref.kind = sourceSnapshot
	default:
		return sourceRef{}, fmt.Errorf("source key %q has an unknown kind", key)
	}
	return ref, nil
}

// setClaimFinalizer adds or removes the cloning finalizer of a source claim: one update of
// the freshest copy this process knows (OwnWrites), with its resource version; a conflict
// goes back to the queue, whose backoff lets the cache catch up (P14).
func (c *controller) setClaimFinalizer(ctx context.Context, ref sourceRef, add bool) error {
	claim := c.claimByName(ref.namespace, ref.name)
	if claim == nil {
		if add {
			return fmt.Errorf("source claim %s not found", ref)
		}
		return nil
	}
	finalizers, changed := withFinalizer(claim.Finalizers, cloneProtectionFinalizer, add)
	if !changed {
		return nil
	}
	update := claim.DeepCopy()
	update.Finalizers = finalizers
	out, err := c.kube.CoreV1().PersistentVolumeClaims(ref.namespace).Update(ctx, update, metav1.UpdateOptions{})
	switch {
	case apierrors.IsNotFound(err) && !add:
		return nil
	case err != nil:
		return fmt.Errorf("setting finalizer %s on claim %s (add=%v): %w", cloneProtectionFinalizer, ref, add, err)
	}
	c.ownClaims.Wrote(out)
	klog.FromContext(ctx).V(3).Info("Cloning protection changed", "claim", ref.String(), "protected", add)
	return nil
}

// setSnapshotFinalizer adds or removes the source-protection finalizer of a snapshot.
//
// Upstream's RBAC grants update on volumesnapshots only from v6.2 on. Under an older one
// the write is forbidden and, as upstream, that is no failure: the restore goes on without
// protection (add), or the finalizer stays for a sweep to retry (remove); a warning says
// so once.
func (c *controller) setSnapshotFinalizer(ctx context.Context, ref sourceRef, add bool) error {
	if c.snapshots == nil {
		return nil
	}
	logger := klog.FromContext(ctx)
	snap, ok, err := c.snapshots.own.Get(ref.namespace + "/" + ref.name)
	switch {
	case err != nil:
		return fmt.Errorf("reading snapshot %s from the cache: %w", ref, err)
	case !ok && add:
		return fmt.Errorf("source snapshot %s not found", ref)
	case !ok:
		return nil
	}
	finalizers, changed := withFinalizer(snap.Finalizers, snapshotProtectionFinalizer, add)
	if !changed {
		return nil
	}
	update := snap.DeepCopy()
	update.Finalizers = finalizers
	out, err := c.snapshots.client.SnapshotV1().VolumeSnapshots(ref.namespace).Update(ctx, update, metav1.UpdateOptions{})
	if err == nil {
		c.snapshots.own.Wrote(out)
	}
	switch {
	case apierrors.IsNotFound(err) && !add:
		return nil
	case apierrors.IsForbidden(err):
		c.snapshots.updateForbidden.report(logger, err, "snapshot", ref.String(), "protect", add)
		return nil
	case err != nil:
		return fmt.Errorf("setting finalizer %s on snapshot %s (add=%v): %w", snapshotProtectionFinalizer, ref, add, err)
	}
	if changed {
		logger.V(3).Info("Snapshot source protection changed", "snapshot", ref.String(), "protected", add)
	}
	return nil
}

// withFinalizer returns finalizers with f added or removed, and whether that changed them.
func withFinalizer(finalizers []string, f string, add bool) ([]string, bool) {
	has := slices.Contains(finalizers, f)
	switch {
	case add && !has:
		return append(slices.Clone(finalizers), f), true
	case !add && has:
		return slices.DeleteFunc(slices.Clone(finalizers), func(x string) bool { return x == f }), true
	}
	return finalizers, false
}

// sweepSnapshots checks every snapshot that carries the provisioner's finalizer, every
// interval until intake ends: a finalizer whose restore is over (a crash, a claim deleted
// meanwhile) goes.
func (c *controller) sweepSnapshots(intake context.Context, interval time.Duration) {
	if c.snapshots == nil || interval <= 0 {
		return
	}
	wait.UntilWithContext(intake, func(context.Context) {
		for _, obj := range c.snapshots.informer.GetStore().List() {
			c.enqueueProtectedSnapshot(obj)
		}
	}, interval)
}
