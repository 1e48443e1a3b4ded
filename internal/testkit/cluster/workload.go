package cluster

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
)

// Stage is a step in the life of a Pod with its own claim. The workload's own actions
// (PodCreated, GrowRequested, ModifyRequested, PodDeleted, ClaimDeleted) are recorded when
// the API call returned; the others when the workload's informers first showed them.
type Stage string

// The stages in the order a Pod normally goes through them.
const (
	// PodCreated: the claim and then the Pod were created.
	PodCreated Stage = "pod-created"
	// NodeSelected: kube-scheduler annotated the claim with the node it chose
	// (volume.kubernetes.io/selected-node).
	NodeSelected Stage = "node-selected"
	// Provisioned: a PersistentVolume's claimRef names the claim (the provisioner).
	Provisioned Stage = "provisioned"
	// Bound: the claim names its volume and its phase is Bound (the PV controller).
	Bound Stage = "bound"
	// Scheduled: the Pod is bound to a node (kube-scheduler, once its volumes are bound).
	Scheduled Stage = "scheduled"
	// Attached: a VolumeAttachment of the volume to the Pod's node reports attached (the
	// attach-detach controller created it, the attacher published).
	Attached Stage = "attached"
	// GrowRequested: the claim's request was raised.
	GrowRequested Stage = "grow-requested"
	// Grown: the claim's status capacity reached the request (the resizer).
	Grown Stage = "grown"
	// ModifyRequested: the claim's spec.volumeAttributesClassName was changed.
	ModifyRequested Stage = "modify-requested"
	// Modified: the claim's status.currentVolumeAttributesClassName is the class asked
	// for (the resizer's ControllerModifyVolume).
	Modified Stage = "modified"
	// PodDeleted: the Pod was deleted with grace period 0 (gone at once: no kubelet, no
	// finalizers).
	PodDeleted Stage = "pod-deleted"
	// Detached: no VolumeAttachment of the volume to the node is left (the attach-detach
	// controller deleted it, the attacher unpublished and removed its finalizer).
	Detached Stage = "detached"
	// ClaimDeleted: the claim's deletion was requested.
	ClaimDeleted Stage = "claim-deleted"
	// ClaimGone: the claim object is gone (the claim protection controller let it go).
	ClaimGone Stage = "claim-gone"
	// VolumeDeleted: the PersistentVolume is gone (the provisioner deleted the volume and
	// the object, the PV protection controller let it go).
	VolumeDeleted Stage = "volume-deleted"
)

// Stages lists every stage in order.
func Stages() []Stage {
	return []Stage{PodCreated, NodeSelected, Provisioned, Bound, Scheduled, Attached, GrowRequested, Grown,
		ModifyRequested, Modified, PodDeleted, Detached, ClaimDeleted, ClaimGone, VolumeDeleted}
}

// implied are the stages a stage cannot be reached without. Informers of different kinds
// deliver their events independently, so a later stage may be seen first (a new
// PersistentVolume before the claim's selected-node annotation); the earlier one is then
// recorded at the same time, so that no span is negative.
var implied = map[Stage][]Stage{
	Provisioned:   {NodeSelected},
	Bound:         {Provisioned},
	Scheduled:     {Provisioned}, // the scheduler binds the Pod once its volume is provisioned
	Attached:      {Scheduled, Bound},
	VolumeDeleted: {ClaimGone},
}

// Span is the time from the latest of From to To, per Pod that reached all of them.
type Span struct {
	Name string
	From []Stage
	To   Stage
}

// DefaultSpans are the spans Summary reports: each step, and the whole way from the Pod's
// creation to its volume attached.
func DefaultSpans() []Span {
	return []Span{
		{"select node", []Stage{PodCreated}, NodeSelected},
		{"provision", []Stage{NodeSelected}, Provisioned},
		{"bind claim", []Stage{Provisioned}, Bound},
		{"schedule pod", []Stage{Provisioned}, Scheduled},
		{"attach", []Stage{Scheduled, Bound}, Attached},
		{"create to attached", []Stage{PodCreated}, Attached},
		{"grow", []Stage{GrowRequested}, Grown},
		{"modify", []Stage{ModifyRequested}, Modified},
		{"detach", []Stage{PodDeleted}, Detached},
		{"delete claim", []Stage{ClaimDeleted}, ClaimGone},
		{"delete volume", []Stage{ClaimGone}, VolumeDeleted},
	}
}

// WorkloadOptions configures NewWorkload.
type WorkloadOptions struct {
	// Namespace of the Pods and claims; it must exist. Its "default" ServiceAccount is
	// created if missing.
	Namespace string
	// Driver is the CSI driver (the StorageClass's provisioner).
	Driver string
	// Class names the StorageClass NewWorkload creates (WaitForFirstConsumer, reclaim
	// Delete, expandable); Close deletes it. Default: <Namespace>-wffc.
	Class string
	// Parameters of the StorageClass.
	Parameters map[string]string
	// Size is each new claim's request. Default: 1Gi.
	Size string
	// Image of the Pods' container; it never runs. Default: registry.k8s.io/pause:3.10.
	Image string
	// AttributesClass names a VolumeAttributesClass (storage.k8s.io/v1) of the driver that
	// NewWorkload creates with AttributesParameters, for Modify; Close deletes it. Default:
	// none is created.
	AttributesClass      string
	AttributesParameters map[string]string
}

// Workload creates Pods, each with a new claim of its own of one WaitForFirstConsumer
// StorageClass, deletes and recreates the Pods, grows, modifies (a new
// VolumeAttributesClass) and deletes the claims, and records
// when each Pod reached each Stage. A Pod and its claim have the same name. Its methods are
// safe for concurrent use.
type Workload struct {
	kube    kubernetes.Interface
	opts    WorkloadOptions
	size    resource.Quantity
	factory informers.SharedInformerFactory
	stop    chan struct{}

	pods   corelisters.PodLister
	claims corelisters.PersistentVolumeClaimLister
	pvs    cache.Indexer // by claim UID
	vas    cache.Indexer // by PersistentVolume name

	mu      sync.Mutex
	items   map[string]*item
	order   []string
	changed chan struct{} // closed and replaced whenever a stage is recorded

	closeOnce sync.Once
}

// item is one Pod and its claim.
type item struct {
	name     string
	claimUID types.UID
	podUID   types.UID
	pv       string // the PersistentVolume, once provisioned
	handle   string // its CSI volume handle
	node     string // the Pod's node, once scheduled
	va       string // the VolumeAttachment of the volume to the node, once seen
	grownTo  *resource.Quantity
	modifyTo string // the VolumeAttributesClass asked for, once Modify was called
	times    map[Stage]time.Time
}

// Item is what the workload knows of a Pod and its claim: the names and handle found so
// far and when each stage was reached.
type Item struct {
	Name             string
	ClaimUID         types.UID
	PersistentVolume string
	VolumeHandle     string
	Node             string
	VolumeAttachment string
	Times            map[Stage]time.Time
}

const (
	indexByClaimUID = "claimUID"
	indexByPV       = "persistentVolume"
)

// NewWorkload creates the StorageClass and the namespace's default ServiceAccount, and
// starts the informers it tracks the stages with (Pods and claims of the namespace, the
// driver's PersistentVolumes and VolumeAttachments); it returns once they are synced.
// Close stops them.
func NewWorkload(ctx context.Context, kube kubernetes.Interface, opts WorkloadOptions) (*Workload, error) {
	if opts.Namespace == "" || opts.Driver == "" {
		return nil, fmt.Errorf("cluster: a workload needs a namespace and a driver")
	}
	if opts.Class == "" {
		opts.Class = opts.Namespace + "-wffc"
	}
	if opts.Size == "" {
		opts.Size = "1Gi"
	}
	if opts.Image == "" {
		opts.Image = "registry.k8s.io/pause:3.10"
	}
	size, err := resource.ParseQuantity(opts.Size)
	if err != nil {
		return nil, fmt.Errorf("cluster: workload size %q: %w", opts.Size, err)
	}
	if err := EnsureServiceAccount(ctx, kube, opts.Namespace); err != nil {
		return nil, err
	}
	class := &storagev1.StorageClass{
		ObjectMeta:           metav1.ObjectMeta{Name: opts.Class},
		Provisioner:          opts.Driver,
		Parameters:           opts.Parameters,
		ReclaimPolicy:        ptr.To(corev1.PersistentVolumeReclaimDelete),
		VolumeBindingMode:    ptr.To(storagev1.VolumeBindingWaitForFirstConsumer),
		AllowVolumeExpansion: ptr.To(true),
	}
	if _, err := kube.StorageV1().StorageClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("cluster: create StorageClass %s: %w", opts.Class, err)
	}
	if opts.AttributesClass != "" {
		vac := &storagev1.VolumeAttributesClass{
			ObjectMeta: metav1.ObjectMeta{Name: opts.AttributesClass},
			DriverName: opts.Driver,
			Parameters: opts.AttributesParameters,
		}
		if _, err := kube.StorageV1().VolumeAttributesClasses().Create(ctx, vac, metav1.CreateOptions{}); err != nil {
			_ = kube.StorageV1().StorageClasses().Delete(ctx, opts.Class, metav1.DeleteOptions{})
			return nil, fmt.Errorf("cluster: create VolumeAttributesClass %s: %w", opts.AttributesClass, err)
		}
	}

	w := &Workload{kube: kube, opts: opts, size: size, stop: make(chan struct{}), items: map[string]*item{}, changed: make(chan struct{})}
	w.factory = informers.NewSharedInformerFactoryWithOptions(kube, 0, informers.WithNamespace(opts.Namespace))
	pods := w.factory.Core().V1().Pods()
	claims := w.factory.Core().V1().PersistentVolumeClaims()
	pvs := w.factory.Core().V1().PersistentVolumes().Informer()
	vas := w.factory.Storage().V1().VolumeAttachments().Informer()
	w.pods, w.claims = pods.Lister(), claims.Lister()
	err = pvs.AddIndexers(cache.Indexers{indexByClaimUID: func(obj any) ([]string, error) {
		pv, ok := obj.(*corev1.PersistentVolume)
		if !ok || pv.Spec.ClaimRef == nil || pv.Spec.CSI == nil || pv.Spec.CSI.Driver != opts.Driver {
			return nil, nil
		}
		return []string{string(pv.Spec.ClaimRef.UID)}, nil
	}})
	if err == nil {
		err = vas.AddIndexers(cache.Indexers{indexByPV: func(obj any) ([]string, error) {
			va, ok := obj.(*storagev1.VolumeAttachment)
			if !ok || va.Spec.Attacher != opts.Driver || va.Spec.Source.PersistentVolumeName == nil {
				return nil, nil
			}
			return []string{*va.Spec.Source.PersistentVolumeName}, nil
		}})
	}
	if err != nil {
		w.Close()
		return nil, fmt.Errorf("cluster: workload indexers: %w", err)
	}
	w.pvs, w.vas = pvs.GetIndexer(), vas.GetIndexer()
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { w.observe() },
		UpdateFunc: func(any, any) { w.observe() },
		DeleteFunc: func(any) { w.observe() },
	}
	for _, inf := range []cache.SharedIndexInformer{pods.Informer(), claims.Informer(), pvs, vas} {
		if _, err := inf.AddEventHandler(handler); err != nil {
			w.Close()
			return nil, fmt.Errorf("cluster: workload event handler: %w", err)
		}
	}
	w.factory.Start(w.stop)
	for typ, ok := range w.factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			w.Close()
			return nil, fmt.Errorf("cluster: workload informer of %v not synced: %w", typ, ctx.Err())
		}
	}
	return w, nil
}

// Close stops the informers and deletes the StorageClass and the VolumeAttributesClass.
// Pods and claims stay.
func (w *Workload) Close() {
	w.closeOnce.Do(func() {
		close(w.stop)
		w.factory.Shutdown()
		ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		defer cancel()
		_ = w.kube.StorageV1().StorageClasses().Delete(ctx, w.opts.Class, metav1.DeleteOptions{})
		if w.opts.AttributesClass != "" {
			_ = w.kube.StorageV1().VolumeAttributesClasses().Delete(ctx, w.opts.AttributesClass, metav1.DeleteOptions{})
		}
	})
}

// Class is the StorageClass of the claims.
func (w *Workload) Class() string { return w.opts.Class }

// AttributesClass is the VolumeAttributesClass NewWorkload created, "" if none.
func (w *Workload) AttributesClass() string { return w.opts.AttributesClass }

// CreatePod creates a claim named name of the class and a Pod of the same name using it.
func (w *Workload) CreatePod(ctx context.Context, name string) error {
	w.mu.Lock()
	_, taken := w.items[name]
	w.mu.Unlock()
	if taken {
		return fmt.Errorf("cluster: the workload already has a Pod %s", name)
	}
	claim := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: w.opts.Namespace},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: ptr.To(w.opts.Class),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: w.size}},
		},
	}
	claim, err := w.kube.CoreV1().PersistentVolumeClaims(w.opts.Namespace).Create(ctx, claim, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("cluster: create claim %s: %w", name, err)
	}
	pod, err := w.createPod(ctx, name)
	if err != nil {
		return err
	}
	w.mu.Lock()
	it := &item{name: name, claimUID: claim.UID, podUID: pod.UID, times: map[Stage]time.Time{}}
	w.items[name] = it
	w.order = append(w.order, name)
	w.recordLocked(it, PodCreated, time.Now())
	w.evaluateLocked(it, time.Now())
	w.mu.Unlock()
	return nil
}

// createPod creates the Pod name, which mounts the claim of the same name.
func (w *Workload) createPod(ctx context.Context, name string) (*corev1.Pod, error) {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: w.opts.Namespace},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{
				Name: "app", Image: w.opts.Image,
				VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}},
			}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: name},
			}}},
			AutomountServiceAccountToken:  ptr.To(false),
			EnableServiceLinks:            ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](0),
		},
	}
	pod, err := w.kube.CoreV1().Pods(w.opts.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("cluster: create Pod %s: %w", name, err)
	}
	return pod, nil
}

// RecreatePod creates a deleted Pod again, with the same claim, as a rollout replaces a
// Pod: once its claim is bound, kube-scheduler binds it to the volume's node at once and
// kube-controller-manager attaches the volume there anew. The Pod's stages (Scheduled,
// Attached, PodDeleted, Detached) are then recorded anew; the claim's stay. A
// VolumeAttachment of the old Pod still present on the new Pod's node counts for it, as it
// does for kube-controller-manager, so wait for Detached first to see a new attachment.
func (w *Workload) RecreatePod(ctx context.Context, name string) error {
	it, err := w.item(name)
	if err != nil {
		return err
	}
	w.mu.Lock()
	_, deleted := it.times[PodDeleted]
	w.mu.Unlock()
	if !deleted {
		return fmt.Errorf("cluster: recreate Pod %s: it was not deleted", name)
	}
	pod, err := w.createPod(ctx, name)
	if err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	it.podUID, it.node, it.va = pod.UID, "", ""
	for _, s := range []Stage{Scheduled, Attached, PodDeleted, Detached} {
		delete(it.times, s)
	}
	w.evaluateLocked(it, time.Now())
	return nil
}

// Grow raises the claim's request to size.
func (w *Workload) Grow(ctx context.Context, name, size string) error {
	q, err := resource.ParseQuantity(size)
	if err != nil {
		return fmt.Errorf("cluster: grow %s to %q: %w", name, size, err)
	}
	err = w.changeClaim(ctx, name, func(claim *corev1.PersistentVolumeClaim) {
		claim.Spec.Resources.Requests[corev1.ResourceStorage] = q
	}, func(it *item) {
		it.grownTo = &q
		delete(it.times, Grown) // a second growth is waited for anew
		w.recordLocked(it, GrowRequested, time.Now())
	})
	if err != nil {
		return fmt.Errorf("cluster: grow claim %s to %s: %w", name, size, err)
	}
	return nil
}

// Modify sets the claim's spec.volumeAttributesClassName to class (a claim in use may
// change it; the resizer applies it with ControllerModifyVolume). Modified is reached
// when the claim's status.currentVolumeAttributesClassName is class.
func (w *Workload) Modify(ctx context.Context, name, class string) error {
	err := w.changeClaim(ctx, name, func(claim *corev1.PersistentVolumeClaim) {
		claim.Spec.VolumeAttributesClassName = ptr.To(class)
	}, func(it *item) {
		it.modifyTo = class
		delete(it.times, Modified) // a second modification is waited for anew
		w.recordLocked(it, ModifyRequested, time.Now())
	})
	if err != nil {
		return fmt.Errorf("cluster: modify claim %s to class %s: %w", name, class, err)
	}
	return nil
}

// changeClaim applies change to the claim in the API server, then, under the workload's
// lock, note to its item, and evaluates it. The sidecars and kube-controller-manager write
// the claim too: it reads again on conflict.
func (w *Workload) changeClaim(ctx context.Context, name string, change func(*corev1.PersistentVolumeClaim), note func(*item)) error {
	it, err := w.item(name)
	if err != nil {
		return err
	}
	claims := w.kube.CoreV1().PersistentVolumeClaims(w.opts.Namespace)
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		claim, err := claims.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		change(claim)
		_, err = claims.Update(ctx, claim, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	note(it)
	w.evaluateLocked(it, time.Now())
	return nil
}

// DeletePod deletes the Pod with grace period 0: without a kubelet nobody would confirm a
// graceful end.
func (w *Workload) DeletePod(ctx context.Context, name string) error {
	it, err := w.item(name)
	if err != nil {
		return err
	}
	w.mu.Lock()
	uid := it.podUID // RecreatePod replaces it
	w.mu.Unlock()
	err = w.kube.CoreV1().Pods(w.opts.Namespace).Delete(ctx, name, metav1.DeleteOptions{
		GracePeriodSeconds: ptr.To[int64](0),
		Preconditions:      &metav1.Preconditions{UID: &uid},
	})
	if err != nil {
		return fmt.Errorf("cluster: delete Pod %s: %w", name, err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.recordLocked(it, PodDeleted, time.Now())
	w.evaluateLocked(it, time.Now())
	return nil
}

// DeleteClaim deletes the claim.
func (w *Workload) DeleteClaim(ctx context.Context, name string) error {
	it, err := w.item(name)
	if err != nil {
		return err
	}
	err = w.kube.CoreV1().PersistentVolumeClaims(w.opts.Namespace).Delete(ctx, name, metav1.DeleteOptions{
		Preconditions: &metav1.Preconditions{UID: &it.claimUID},
	})
	if err != nil {
		return fmt.Errorf("cluster: delete claim %s: %w", name, err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.recordLocked(it, ClaimDeleted, time.Now())
	w.evaluateLocked(it, time.Now())
	return nil
}

func (w *Workload) item(name string) (*item, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	it := w.items[name]
	if it == nil {
		return nil, fmt.Errorf("cluster: the workload has no Pod %s", name)
	}
	return it, nil
}

// Names are the workload's Pods in the order they were created.
func (w *Workload) Names() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.order)
}

// Item returns what the workload knows of a Pod and its claim.
func (w *Workload) Item(name string) (Item, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	it := w.items[name]
	if it == nil {
		return Item{}, false
	}
	times := make(map[Stage]time.Time, len(it.times))
	for s, t := range it.times {
		times[s] = t
	}
	return Item{Name: it.name, ClaimUID: it.claimUID, PersistentVolume: it.pv, VolumeHandle: it.handle, Node: it.node,
		VolumeAttachment: it.va, Times: times}, true
}

// Wait blocks until every named Pod (every Pod when names is empty) has reached stage, or
// ctx ends; the error then says where each Pod still waiting stands.
func (w *Workload) Wait(ctx context.Context, stage Stage, names ...string) error {
	for {
		w.mu.Lock()
		if len(names) == 0 {
			names = slices.Clone(w.order)
		}
		var waiting []string
		for _, name := range names {
			it := w.items[name]
			if it == nil {
				w.mu.Unlock()
				return fmt.Errorf("cluster: the workload has no Pod %s", name)
			}
			if _, ok := it.times[stage]; !ok {
				waiting = append(waiting, name)
			}
		}
		changed := w.changed
		w.mu.Unlock()
		if len(waiting) == 0 {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("cluster: %d of %d Pods did not reach %s: %w\n%s", len(waiting), len(names), stage, ctx.Err(), w.describe(waiting))
		}
	}
}

// describe tells where each named Pod stands, from the informers' view, for errors.
func (w *Workload) describe(names []string) string {
	const most = 10
	var b strings.Builder
	for i, name := range names {
		if i == most {
			fmt.Fprintf(&b, "  ... and %d more\n", len(names)-most)
			break
		}
		w.mu.Lock()
		it := w.items[name]
		var reached []string
		for _, s := range Stages() {
			if _, ok := it.times[s]; ok {
				reached = append(reached, string(s))
			}
		}
		pvName := it.pv
		w.mu.Unlock()
		fmt.Fprintf(&b, "  %s: reached [%s]", name, strings.Join(reached, " "))
		if claim, err := w.claims.PersistentVolumeClaims(w.opts.Namespace).Get(name); err == nil {
			fmt.Fprintf(&b, "; claim %s, volumeName %q, selected-node %q, capacity %s, finalizers %v", claim.Status.Phase, claim.Spec.VolumeName,
				claim.Annotations["volume.kubernetes.io/selected-node"], quantityString(claim.Status.Capacity), claim.Finalizers)
			if c := claim.Spec.VolumeAttributesClassName; c != nil {
				fmt.Fprintf(&b, ", attributes class %q (current %q, modify status %+v)", *c,
					ptr.Deref(claim.Status.CurrentVolumeAttributesClassName, ""), claim.Status.ModifyVolumeStatus)
			}
		} else {
			b.WriteString("; no claim")
		}
		if pod, err := w.pods.Pods(w.opts.Namespace).Get(name); err == nil {
			fmt.Fprintf(&b, "; Pod node %q", pod.Spec.NodeName)
			for _, c := range pod.Status.Conditions {
				if c.Type == corev1.PodScheduled && c.Status != corev1.ConditionTrue {
					fmt.Fprintf(&b, " (%s: %s)", c.Reason, c.Message)
				}
			}
		} else {
			b.WriteString("; no Pod")
		}
		if pvName != "" {
			if obj, ok, _ := w.pvs.GetByKey(pvName); ok {
				pv := obj.(*corev1.PersistentVolume)
				fmt.Fprintf(&b, "; PV %s %s, deleting %v, finalizers %v", pvName, pv.Status.Phase, pv.DeletionTimestamp != nil, pv.Finalizers)
			} else {
				fmt.Fprintf(&b, "; PV %s gone", pvName)
			}
			vas, _ := w.vas.ByIndex(indexByPV, pvName)
			for _, obj := range vas {
				va := obj.(*storagev1.VolumeAttachment)
				fmt.Fprintf(&b, "; VolumeAttachment %s on %s attached %v, deleting %v", va.Name, va.Spec.NodeName, va.Status.Attached, va.DeletionTimestamp != nil)
				if e := va.Status.AttachError; e != nil {
					fmt.Fprintf(&b, " attachError %q", e.Message)
				}
				if e := va.Status.DetachError; e != nil {
					fmt.Fprintf(&b, " detachError %q", e.Message)
				}
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

func quantityString(l corev1.ResourceList) string {
	q, ok := l[corev1.ResourceStorage]
	if !ok {
		return "none"
	}
	return q.String()
}

// observe is every informer's event handler: it looks at each Pod still under way.
func (w *Workload) observe() {
	w.mu.Lock()
	defer w.mu.Unlock()
	// The time is read under the lock: read before it, a handler that waited for the lock
	// would record a stage it sees only now at a time before stages others recorded meanwhile.
	now := time.Now()
	for _, it := range w.items {
		w.evaluateLocked(it, now)
	}
}

// evaluateLocked records the stages the informers show it has reached. The caller holds
// w.mu. Cached objects are only read.
func (w *Workload) evaluateLocked(it *item, now time.Time) {
	if _, done := it.times[VolumeDeleted]; done {
		return
	}
	_, claimDeleted := it.times[ClaimDeleted]
	claim, err := w.claims.PersistentVolumeClaims(w.opts.Namespace).Get(it.name)
	switch {
	case err == nil && claim.UID == it.claimUID:
		if claim.Annotations["volume.kubernetes.io/selected-node"] != "" {
			w.recordLocked(it, NodeSelected, now)
		}
		if claim.Spec.VolumeName != "" && claim.Status.Phase == corev1.ClaimBound {
			w.recordLocked(it, Bound, now)
		}
		if it.grownTo != nil {
			if c, ok := claim.Status.Capacity[corev1.ResourceStorage]; ok && c.Cmp(*it.grownTo) >= 0 {
				w.recordLocked(it, Grown, now)
			}
		}
		if it.modifyTo != "" {
			if c := claim.Status.CurrentVolumeAttributesClassName; c != nil && *c == it.modifyTo {
				w.recordLocked(it, Modified, now)
			}
		}
	case claimDeleted && (apierrors.IsNotFound(err) || err == nil):
		// Not found, or a new claim of the same name.
		w.recordLocked(it, ClaimGone, now)
	}

	if it.pv == "" {
		if objs, _ := w.pvs.ByIndex(indexByClaimUID, string(it.claimUID)); len(objs) > 0 {
			pv := objs[0].(*corev1.PersistentVolume)
			it.pv, it.handle = pv.Name, pv.Spec.CSI.VolumeHandle
			w.recordLocked(it, Provisioned, now)
		}
	} else if claimDeleted {
		if _, ok, _ := w.pvs.GetByKey(it.pv); !ok {
			w.recordLocked(it, VolumeDeleted, now)
		}
	}

	if pod, err := w.pods.Pods(w.opts.Namespace).Get(it.name); err == nil && pod.UID == it.podUID && pod.Spec.NodeName != "" {
		it.node = pod.Spec.NodeName
		w.recordLocked(it, Scheduled, now)
	}

	if it.pv != "" && it.node != "" {
		objs, _ := w.vas.ByIndex(indexByPV, it.pv)
		present := false
		for _, obj := range objs {
			va := obj.(*storagev1.VolumeAttachment)
			if va.Spec.NodeName != it.node {
				continue
			}
			present = true
			it.va = va.Name
			if va.Status.Attached {
				w.recordLocked(it, Attached, now)
			}
		}
		_, attached := it.times[Attached]
		_, podDeleted := it.times[PodDeleted]
		if !present && attached && podDeleted {
			w.recordLocked(it, Detached, now)
		}
	}
}

// recordLocked records that it reached stage at t, and the stages that implies, unless
// they were recorded before. The caller holds w.mu.
func (w *Workload) recordLocked(it *item, stage Stage, t time.Time) {
	if _, ok := it.times[stage]; ok {
		return
	}
	for _, before := range implied[stage] {
		w.recordLocked(it, before, t)
	}
	it.times[stage] = t
	close(w.changed)
	w.changed = make(chan struct{})
}

// Durations are the span's durations, one per Pod that reached all its stages, in the
// order the Pods were created.
func (w *Workload) Durations(span Span) []time.Duration {
	ds, _, _ := w.durations(span)
	return ds
}

// durations are the span's durations and the first start and last end among them.
func (w *Workload) durations(span Span) (out []time.Duration, first, last time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, name := range w.order {
		it := w.items[name]
		end, ok := it.times[span.To]
		if !ok {
			continue
		}
		var start time.Time
		for _, s := range span.From {
			t, ok := it.times[s]
			if !ok {
				start = time.Time{}
				break
			}
			if t.After(start) {
				start = t
			}
		}
		if start.IsZero() {
			continue
		}
		out = append(out, end.Sub(start))
		if first.IsZero() || start.Before(first) {
			first = start
		}
		if end.After(last) {
			last = end
		}
	}
	return out, first, last
}

// SpanSummary is a span's figures over the Pods that went through it.
type SpanSummary struct {
	Span          Span
	N             int
	P50, P99, Max time.Duration
	// PerSecond is the span's throughput: N over the time from the first Pod's start of
	// the span to the last Pod's end of it (0 when that is no time).
	PerSecond float64
}

// Summary is each span's figures, for the Pods that went through it; spans nobody went
// through are left out.
func (w *Workload) Summary(spans ...Span) []SpanSummary {
	if len(spans) == 0 {
		spans = DefaultSpans()
	}
	var out []SpanSummary
	for _, span := range spans {
		ds, first, last := w.durations(span)
		if len(ds) == 0 {
			continue
		}
		r := SpanSummary{Span: span, N: len(ds), P50: Percentile(ds, 50), P99: Percentile(ds, 99), Max: Percentile(ds, 100)}
		if d := last.Sub(first); d > 0 {
			r.PerSecond = float64(len(ds)) / d.Seconds()
		}
		out = append(out, r)
	}
	return out
}

// FormatSummary renders a summary as an aligned table.
func FormatSummary(rows []SpanSummary) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-20s %-32s %4s %9s %9s %9s %7s\n", "span", "from -> to", "n", "p50", "p99", "max", "per s")
	for _, r := range rows {
		from := make([]string, len(r.Span.From))
		for i, s := range r.Span.From {
			from[i] = string(s)
		}
		fmt.Fprintf(&b, "%-20s %-32s %4d %9s %9s %9s %7.2f\n", r.Span.Name, strings.Join(from, "+")+" -> "+string(r.Span.To), r.N,
			r.P50.Round(time.Millisecond), r.P99.Round(time.Millisecond), r.Max.Round(time.Millisecond), r.PerSecond)
	}
	return b.String()
}

// Percentile is the p-th percentile (0 < p <= 100) of ds by the nearest-rank method: the
// smallest value at least p percent of the values are at or below. 0 for no values.
func Percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	sorted := slices.Clone(ds)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i] < sorted[j] })
	rank := int(math.Ceil(float64(len(sorted)) * p / 100))
	rank = min(max(rank, 1), len(sorted))
	return sorted[rank-1]
}
