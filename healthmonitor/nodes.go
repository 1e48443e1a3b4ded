package healthmonitor

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// notReadyFor is how long a node must stay NotReady before its claims are reported on a
// failed node, as upstream.
const notReadyFor = 5 * time.Minute

// podsByNode is the index of the node watcher's Pod informer.
const podsByNode = "node"

// nodeWatcher is upstream's node watcher (--enable-node-watcher): a claim of the driver
// that a Pod on a failed node uses gets a NodeFailed event, and a NodeRecovered one when
// the node is Ready again. A node has failed when it is deleted, Terminated, or NotReady
// for notReadyFor. Unlike upstream, each failure and each recovery is reported once, the
// NotReady timer is checked when it runs out rather than at the next node event or list,
// and a deleted node is handled (upstream's handler dereferences the missing node).
//
// The shared informers' Pods keep no node name (lifecycle.CachedPod), so the watcher runs
// a Pod informer of its own that keeps only a Pod's name, node and claims.
type nodeWatcher struct {
	driver   string
	nodes    corelisters.NodeLister
	pods     cache.SharedIndexInformer
	poller   *poller
	recorder record.EventRecorder
	queue    *lifecycle.Queue[string]
	interval time.Duration

	mu sync.Mutex
	// notReady holds when each NotReady node was first seen so.
	notReady map[string]time.Time
	// failed holds the nodes reported failed, until they recover.
	failed map[string]bool
}

func newNodeWatcher(env *lifecycle.Env, recorder record.EventRecorder, p *poller, interval time.Duration, metrics workqueue.MetricsProvider) (*nodeWatcher, error) {
	w := &nodeWatcher{
		driver: env.DriverName, poller: p, recorder: recorder, interval: interval,
		queue:    lifecycle.NewQueue[string](lifecycle.QueueOptions{Name: "nodes", RetryStart: time.Second, RetryMax: time.Minute, Metrics: metrics, Backlog: env.Backlog}),
		notReady: map[string]time.Time{}, failed: map[string]bool{},
	}
	nodeInformer := env.Informers.Core().V1().Nodes()
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			w.queue.Add(key)
		}
	}
	if _, err := nodeInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueue, UpdateFunc: func(_, obj any) { enqueue(obj) }, DeleteFunc: enqueue,
	}); err != nil {
		return nil, fmt.Errorf("watching Nodes: %w", err)
	}
	w.nodes = nodeInformer.Lister()

	pods := env.Kube.CoreV1().Pods(v1.NamespaceAll)
	w.pods = cache.NewSharedIndexInformerWithOptions(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return pods.List(ctx, o) },
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return pods.Watch(ctx, o)
		},
	}, &v1.Pod{}, cache.SharedIndexInformerOptions{Indexers: cache.Indexers{podsByNode: func(obj any) ([]string, error) {
		return []string{obj.(*v1.Pod).Spec.NodeName}, nil
	}}})
	if err := w.pods.SetTransform(trimPod); err != nil {
		return nil, fmt.Errorf("trimming the node watcher's Pods: %w", err)
	}
	go w.pods.RunWithContext(doneContext(env.Done()))
	return w, nil
}

// trimPod keeps what the node watcher reads of a Pod: its name, node and claims.
func trimPod(obj any) (any, error) {
	pod, ok := obj.(*v1.Pod)
	if !ok {
		return obj, nil
	}
	out := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID, ResourceVersion: pod.ResourceVersion}}
	out.Spec.NodeName = pod.Spec.NodeName
	for _, vol := range pod.Spec.Volumes {
		if vol.PersistentVolumeClaim != nil {
			out.Spec.Volumes = append(out.Spec.Volumes, v1.Volume{Name: vol.Name, VolumeSource: v1.VolumeSource{
				PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: vol.PersistentVolumeClaim.ClaimName}}})
		}
	}
	return out, nil
}

// doneContext is a context that ends when done is closed.
func doneContext(done <-chan struct{}) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-done
		cancel()
	}()
	return ctx
}

// run checks nodes as their events come and every interval, until intake ends.
func (w *nodeWatcher) run(intake context.Context) {
	if !cache.WaitForCacheSync(intake.Done(), w.pods.HasSynced) {
		return
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		every(intake, w.interval, func() {
			nodes, _ := w.nodes.List(labels.Everything())
			for _, n := range nodes {
				w.queue.Add(n.Name)
			}
		})
	})
	lifecycle.RunWorkers(intake, w.queue, 1, w.check)
	wg.Wait()
}

// check decides on one node.
func (w *nodeWatcher) check(name string) error {
	node, err := w.nodes.Get(name)
	switch {
	case apierrors.IsNotFound(err):
		w.fail(name)
		w.mu.Lock()
		delete(w.failed, name)
		delete(w.notReady, name)
		w.mu.Unlock()
		return nil
	case err != nil:
		return err
	}
	if ready(node) {
		w.mu.Lock()
		delete(w.notReady, name)
		wasFailed := w.failed[name]
		delete(w.failed, name)
		w.mu.Unlock()
		if wasFailed {
			w.report(name, func(claim *v1.PersistentVolumeClaim, _ []string) {
				w.recorder.Event(claim, v1.EventTypeWarning, "NodeRecovered", "Node: "+name+" recovered")
			})
		}
		return nil
	}
	if node.Status.Phase != v1.NodeTerminated {
		w.mu.Lock()
		since, ok := w.notReady[name]
		if !ok {
			since = time.Now()
			w.notReady[name] = since
		}
		w.mu.Unlock()
		if left := notReadyFor - time.Since(since); left > 0 {
			w.queue.AddAfter(name, left)
			return nil
		}
	}
	w.fail(name)
	return nil
}

// fail reports the claims used on node name as on a failed node, once per failure.
func (w *nodeWatcher) fail(name string) {
	w.mu.Lock()
	already := w.failed[name]
	w.failed[name] = true
	w.mu.Unlock()
	if already {
		return
	}
	w.report(name, func(claim *v1.PersistentVolumeClaim, pods []string) {
		msg := "Pods: [ " + strings.Join(pods, " ") + " ] consuming PVC: " + claim.Name + " in namespace: " + claim.Namespace + " are now on a failed node: " + name
		w.recorder.Event(claim, v1.EventTypeWarning, "NodeFailed", msg)
	})
}

// report calls emit for each claim of a bound volume of the driver that Pods on node use,
// with those Pods' names.
func (w *nodeWatcher) report(node string, emit func(claim *v1.PersistentVolumeClaim, pods []string)) {
	objs, err := w.pods.GetIndexer().ByIndex(podsByNode, node)
	if err != nil || len(objs) == 0 {
		return
	}
	users := map[string][]string{} // claim key -> pod names
	for _, obj := range objs {
		pod := obj.(*v1.Pod)
		for _, vol := range pod.Spec.Volumes {
			key := pod.Namespace + "/" + vol.PersistentVolumeClaim.ClaimName
			users[key] = append(users[key], pod.Name)
		}
	}
	for _, pv := range w.poller.boundVolumes() {
		ref := pv.Spec.ClaimRef
		pods, ok := users[ref.Namespace+"/"+ref.Name]
		if !ok {
			continue
		}
		if claim := w.poller.reporter.claimOf(pv); claim != nil {
			slices.Sort(pods)
			emit(claim, pods)
		}
	}
	klog.Background().V(4).Info("Checked the claims on a node", "node", node)
}

func ready(node *v1.Node) bool {
	for _, c := range node.Status.Conditions {
		if c.Type == v1.NodeReady {
			return c.Status == v1.ConditionTrue
		}
	}
	return false
}
