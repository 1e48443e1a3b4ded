package capacity

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/testing/protocmp"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	metadatafake "k8s.io/client-go/metadata/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/component-base/metrics"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cachetest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

const capNS = "kube-system"

func TestDriverSegmentsComeFromTheDriversTopologyKeysAndTheNodesLabels(t *testing.T) {
	node := func(name string, l map[string]string) *v1.Node {
		return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: l}}
	}
	csiNode := func(name string, drivers ...storagev1.CSINodeDriver) *storagev1.CSINode {
		return &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: storagev1.CSINodeSpec{Drivers: drivers}}
	}
	ours := func(keys ...string) storagev1.CSINodeDriver {
		return storagev1.CSINodeDriver{Name: drv, TopologyKeys: keys}
	}
	for _, tc := range []struct {
		name     string
		csiNodes []*storagev1.CSINode
		nodes    []*v1.Node
		want     []map[string]string
	}{
		{"one segment per distinct value set",
			[]*storagev1.CSINode{csiNode("a", ours("zone", "rack")), csiNode("b", ours("zone", "rack")), csiNode("c", ours("zone", "rack"))},
			[]*v1.Node{node("a", map[string]string{"zone": "1", "rack": "x", "other": "o"}), node("b", map[string]string{"zone": "1", "rack": "x"}), node("c", map[string]string{"zone": "2", "rack": "y"})},
			[]map[string]string{{"zone": "1", "rack": "x"}, {"zone": "2", "rack": "y"}}},
		{"nodes without the driver or without their Node are skipped",
			[]*storagev1.CSINode{csiNode("a", storagev1.CSINodeDriver{Name: "other", TopologyKeys: []string{"zone"}}), csiNode("b", ours("zone"))},
			[]*v1.Node{node("a", map[string]string{"zone": "1"})},
			nil},
		{"a node whose labels lack a key waits for them",
			[]*storagev1.CSINode{csiNode("a", ours("zone", "rack")), csiNode("b", ours("zone"))},
			[]*v1.Node{node("a", map[string]string{"zone": "1"}), node("b", map[string]string{"zone": "2"})},
			[]map[string]string{{"zone": "2"}}},
		{"a driver without topology has the empty segment",
			[]*storagev1.CSINode{csiNode("a", ours()), csiNode("b", ours())},
			[]*v1.Node{node("a", nil), node("b", nil)},
			[]map[string]string{{}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if diff := cmp.Diff(tc.want, driverSegments(drv, tc.csiNodes, tc.nodes)); diff != "" {
				t.Errorf("segments (-want +got):\n%s", diff)
			}
		})
	}
}

func TestDesiredCapacitiesAreTheDriversLateBindingClassesTimesSegments(t *testing.T) {
	late := class("late", func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	})
	now := class("now", func(sc *storagev1.StorageClass) { sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingImmediate) })
	other := class("other", func(sc *storagev1.StorageClass) {
		sc.Provisioner = "other.CSI.test"
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	})
	segments := []map[string]string{{"zone": "1"}, {"zone": "2"}}
	keys := func(m map[capacityKey]map[string]string) []string {
		var out []string
		for k := range m {
			out = append(out, k.String())
		}
		slices.Sort(out)
		return out
	}
	classes := []*storagev1.StorageClass{late, now, other}
	if got, want := keys(desiredCapacities(drv, false, classes, segments)), []string{"late@zone=1", "late@zone=2"}; !cmp.Equal(got, want) {
		t.Errorf("late binding only: %v, want %v", got, want)
	}
	if got, want := keys(desiredCapacities(drv, true, classes, segments)), []string{"late@zone=1", "late@zone=2", "now@zone=1", "now@zone=2"}; !cmp.Equal(got, want) {
		t.Errorf("with --capacity-for-immediate-binding: %v, want %v", got, want)
	}
}

// capacityWorld is a capacity tracker on a fake clientset and the test driver, running.
type capacityWorld struct {
	t        *testing.T
	kube     *fake.Clientset
	driver   *testdriver.Backend
	tracker  *Tracker
	registry metrics.KubeRegistry
	stop     context.CancelFunc
	done     chan struct{}
	// conflicts counts the updates of CSIStorageCapacity objects answered 409.
	conflicts atomic.Int64
}

func newCapacityWorld(t *testing.T, dcfg testdriver.Config, change func(*Config), objects ...runtime.Object) *capacityWorld {
	t.Helper()
	dcfg.DriverName = drv
	b, err := testdriver.New(dcfg)
	if err != nil {
		t.Fatal(err)
	}
	w := &capacityWorld{t: t, kube: fake.NewClientset(objects...), driver: b, registry: metrics.NewKubeRegistry(), done: make(chan struct{})}
	// The fake API server neither generates names nor UIDs.
	var n atomic.Int64
	w.kube.PrependReactor("create", "csistoragecapacities", func(a k8stesting.Action) (bool, runtime.Object, error) {
		obj := a.(k8stesting.CreateAction).GetObject().(*storagev1.CSIStorageCapacity)
		if obj.Name == "" {
			i := n.Add(1)
			obj.Name = fmt.Sprintf("%s%d", obj.GenerateName, i)
			obj.UID = types.UID(fmt.Sprintf("uid-%d", i))
		}
		return false, nil, nil
	})
	// Nor does it keep resource versions: numbered as the API server numbers them. An
	// update carrying another version than the stored one is a conflict, as there.
	var rv atomic.Int64
	w.kube.PrependReactor("create", "csistoragecapacities", func(a k8stesting.Action) (bool, runtime.Object, error) {
		a.(k8stesting.CreateAction).GetObject().(*storagev1.CSIStorageCapacity).ResourceVersion = strconv.FormatInt(rv.Add(1)+100, 10)
		return false, nil, nil
	})
	var updates sync.Mutex // one update at a time: compare, then store
	w.kube.PrependReactor("update", "csistoragecapacities", func(a k8stesting.Action) (bool, runtime.Object, error) {
		update := a.(k8stesting.UpdateAction)
		obj := update.GetObject().(*storagev1.CSIStorageCapacity).DeepCopy()
		updates.Lock()
		defer updates.Unlock()
		stored, err := w.kube.Tracker().Get(update.GetResource(), update.GetNamespace(), obj.Name)
		if err != nil {
			return true, nil, err
		}
		if have := stored.(*storagev1.CSIStorageCapacity).ResourceVersion; obj.ResourceVersion != "" && obj.ResourceVersion != have {
			w.conflicts.Add(1)
			return true, nil, apierrors.NewConflict(update.GetResource().GroupResource(), obj.Name, fmt.Errorf("version %s, stored %s", obj.ResourceVersion, have))
		}
		obj.ResourceVersion = strconv.FormatInt(rv.Add(1)+100, 10)
		if err := w.kube.Tracker().Update(update.GetResource(), obj, update.GetNamespace()); err != nil {
			return true, nil, err
		}
		return true, obj, nil
	})
	cfg := Config{
		Driver: drv, Namespace: capNS, ManagedBy: capacityManagedBy,
		PollInterval: time.Hour, Timeout: 5 * time.Second, Threads: 2,
		Kube: w.kube, Ops: context.Background(),
	}
	if change != nil {
		change(&cfg)
	}
	// The test driver in memory, unless the test answers GetCapacity itself: no real I/O,
	// so that a test may run the world in a synctest bubble.
	if cfg.CSI == nil {
		cfg.CSI = csi.NewControllerClient(testdriver.DialInMemory(t, b))
	}
	// Decisions are fed from objects trimmed as the core's caches trim them.
	factory := informers.NewSharedInformerFactoryWithOptions(w.kube, 0, informers.WithTransform(cachetest.Transform()))
	if w.tracker, err = New(cfg, factory, 20*time.Millisecond, 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := w.registry.CustomRegister(NewCollector(w.tracker)); err != nil {
		t.Fatal(err)
	}
	stopInformers := make(chan struct{})
	factory.Start(stopInformers)
	w.tracker.Start(stopInformers)
	intake, stop := context.WithCancel(context.Background())
	w.stop = stop
	go func() {
		defer close(w.done)
		w.tracker.Run(intake)
	}()
	t.Cleanup(func() {
		stop()
		<-w.done
		close(stopInformers)
	})
	return w
}

func (w *capacityWorld) waitFor(what string, cond func() bool) {
	w.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			w.t.Fatalf("waiting for %s: timed out; objects:\n%s", what, w.describe())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// objects lists the CSIStorageCapacity objects of the namespace by "class@segment".
func (w *capacityWorld) objects() map[string]storagev1.CSIStorageCapacity {
	list, err := w.kube.StorageV1().CSIStorageCapacities(capNS).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	out := map[string]storagev1.CSIStorageCapacity{}
	for _, o := range list.Items {
		k := keyOfCapacity(&o).String()
		if _, dup := out[k]; dup {
			k += "#dup-" + o.Name
		}
		out[k] = o
	}
	return out
}

func (w *capacityWorld) describe() string {
	var b strings.Builder
	for k, o := range w.objects() {
		fmt.Fprintf(&b, "  %s: %s capacity=%v max=%v labels=%v\n", k, o.Name, o.Capacity, o.MaximumVolumeSize, o.Labels)
	}
	return b.String()
}

// capacities is "class@segment" -> capacity in bytes of the managed objects.
func (w *capacityWorld) capacities() map[string]int64 {
	out := map[string]int64{}
	for k, o := range w.objects() {
		if o.Labels[capacityManagedByLabel] == capacityManagedBy && o.Capacity != nil {
			out[k] = o.Capacity.Value()
		}
	}
	return out
}

func topologyObjects(nodes ...string) []runtime.Object {
	var out []runtime.Object
	for _, n := range nodes {
		out = append(out,
			&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: n, Labels: map[string]string{testdriver.TopologyKey: n}}},
			&storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: n}, Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{
				{Name: drv, NodeID: n, TopologyKeys: []string{testdriver.TopologyKey}}}}})
	}
	return out
}

func lateClass(name string, params map[string]string) *storagev1.StorageClass {
	return class(name, func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
		sc.Parameters = params
	})
}

func TestCapacityObjectsAppearPerSegmentAndClassFollowTheDriverAndObsoleteOnesGo(t *testing.T) {
	seg := func(n string) map[string]string { return map[string]string{testdriver.TopologyKey: n} }
	rules := []testdriver.CapacityRule{
		{Segment: seg("n1"), Parameters: map[string]string{"type": "fast"}, AvailableCapacity: 100, MaximumVolumeSize: 60, MinimumVolumeSize: 1},
		{Segment: seg("n1"), AvailableCapacity: 1000},
		{Segment: seg("n2"), AvailableCapacity: 2000},
	}
	// Left behind: an object for a class that is gone (ours, obsolete) and another
	// instance's object (a node deployment's: not ours to touch).
	obsolete := &storagev1.CSIStorageCapacity{ObjectMeta: metav1.ObjectMeta{Name: "csisc-old", Namespace: capNS, UID: "old",
		Labels: map[string]string{capacityDriverLabel: drv, capacityManagedByLabel: capacityManagedBy}}, StorageClassName: "gone",
		NodeTopology: &metav1.LabelSelector{MatchLabels: seg("n1")}}
	foreign := obsolete.DeepCopy()
	foreign.Name, foreign.UID, foreign.Labels[capacityManagedByLabel] = "csisc-node", "node", "external-provisioner-n9"
	owner := &metav1.OwnerReference{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "rs", UID: "rs-uid", Controller: ptr.To(true)}
	objs := append(topologyObjects("n1", "n2"),
		lateClass("fast", map[string]string{"type": "fast"}), lateClass("slow", map[string]string{"type": "slow"}),
		class("now", nil), obsolete, foreign)
	w := newCapacityWorld(t, testdriver.Config{Topology: true, CapacityRules: rules}, func(c *Config) {
		c.Owner = owner
		c.PollInterval = 50 * time.Millisecond
	}, objs...)

	want := map[string]int64{
		"fast@" + testdriver.TopologyKey + "=n1": 100, "fast@" + testdriver.TopologyKey + "=n2": 2000,
		"slow@" + testdriver.TopologyKey + "=n1": 1000, "slow@" + testdriver.TopologyKey + "=n2": 2000,
	}
	w.waitFor("one object per segment and late-binding class", func() bool { return cmp.Equal(w.capacities(), want) })
	o := w.objects()["fast@"+testdriver.TopologyKey+"=n1"]
	if o.Labels[capacityDriverLabel] != drv || !strings.HasPrefix(o.Name, capacityGenerateName) ||
		o.MaximumVolumeSize == nil || o.MaximumVolumeSize.Value() != 60 ||
		!cmp.Equal(o.NodeTopology, &metav1.LabelSelector{MatchLabels: seg("n1")}) ||
		len(o.OwnerReferences) != 1 || o.OwnerReferences[0].UID != "rs-uid" {
		t.Errorf("object does not say what upstream's says: %+v", o)
	}
	exists := func(name string) bool {
		_, err := w.kube.StorageV1().CSIStorageCapacities(capNS).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil
	}
	w.waitFor("the obsolete object deleted", func() bool { return !exists("csisc-old") })
	if !exists("csisc-node") {
		t.Errorf("another instance's object was deleted:\n%s", w.describe())
	}
	// The GetCapacity calls carried the segment and the class's parameters.
	for _, c := range w.driver.Journal() {
		// (One may still run under the poll: it has no answer yet.)
		if c.Method == testdriver.MethodGetCapacity && c.Code != "OK" && c.Code != "" {
			t.Errorf("GetCapacity failed: %+v", c)
		}
	}

	// The driver's answers change: the objects follow at the next poll.
	rules[0].AvailableCapacity, rules[2].AvailableCapacity = 50, 0
	w.driver.SetCapacityRules(rules)
	want["fast@"+testdriver.TopologyKey+"=n1"] = 50
	want["fast@"+testdriver.TopologyKey+"=n2"], want["slow@"+testdriver.TopologyKey+"=n2"] = 0, 0
	w.waitFor("objects following the driver", func() bool { return cmp.Equal(w.capacities(), want) })

	// A class goes: its objects go. A node goes: its segment's objects go.
	if err := w.kube.StorageV1().StorageClasses().Delete(context.Background(), "slow", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := w.kube.StorageV1().CSINodes().Delete(context.Background(), "n2", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	want = map[string]int64{"fast@" + testdriver.TopologyKey + "=n1": 50}
	w.waitFor("obsolete objects deleted", func() bool { return cmp.Equal(w.capacities(), want) })

	// The metrics count the tracker's cache, which may show the deletions a moment later.
	wantMetrics := map[string]float64{"csistoragecapacities_desired_goal": 1, "csistoragecapacities_desired_current": 1, "csistoragecapacities_obsolete": 0}
	got := map[string]float64{}
	w.waitFor("the metrics to count the objects left", func() bool {
		families, err := w.registry.Gather()
		if err != nil {
			t.Fatal(err)
		}
		got = map[string]float64{}
		for _, f := range families {
			if strings.HasPrefix(f.GetName(), "csistoragecapacities_") && len(f.GetMetric()) == 1 {
				got[f.GetName()] = f.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return cmp.Equal(wantMetrics, got)
	})
}

func TestAnObjectDeletedBySomeoneElseComesBack(t *testing.T) {
	w := newCapacityWorld(t, testdriver.Config{Topology: true, TotalCapacity: 5000}, nil,
		append(topologyObjects("n1"), lateClass("fast", nil))...)
	key := "fast@" + testdriver.TopologyKey + "=n1"
	w.waitFor("the object", func() bool { return w.capacities()[key] == 5000 })
	name := w.objects()[key].Name
	if err := w.kube.StorageV1().CSIStorageCapacities(capNS).Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the object re-created", func() bool { o, ok := w.objects()[key]; return ok && o.Name != name })
	if n := len(w.objects()); n != 1 {
		t.Errorf("%d objects, want 1:\n%s", n, w.describe())
	}
}

func TestANodeDeploymentTracksItsOwnSegmentOnly(t *testing.T) {
	w := newCapacityWorld(t, testdriver.Config{Topology: true, TotalCapacity: 5000}, func(c *Config) {
		c.NodeSegment = map[string]string{testdriver.TopologyKey: "n1"}
		c.ManagedBy = ManagedByFor("n1")
	}, append(topologyObjects("n1", "n2"), lateClass("fast", nil))...)
	w.waitFor("the node's object", func() bool { return len(w.objects()) == 1 })
	o := w.objects()["fast@"+testdriver.TopologyKey+"=n1"]
	if o.Labels[capacityManagedByLabel] != "external-provisioner-n1" {
		t.Errorf("managed-by %q, want external-provisioner-n1:\n%s", o.Labels[capacityManagedByLabel], w.describe())
	}
}

func TestAGetCapacityInFlightWhenIntakeEndsFinishesAndItsWriteLands(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newCapacityWorld(t, testdriver.Config{Topology: true, TotalCapacity: 5000}, func(c *Config) { c.Threads = 1 },
			append(topologyObjects("n1"), lateClass("fast", nil))...)
		key := "fast@" + testdriver.TopologyKey + "=n1"
		w.waitFor("the object", func() bool { return w.capacities()[key] == 5000 })

		// On the fake clock: the rules change below lands while the call runs.
		w.driver.SetMethodLatency(testdriver.MethodGetCapacity, 3*time.Second)
		w.tracker.queue.Add(capacityKey{class: "fast", segment: testdriver.TopologyKey + "=n1"})
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		inFlight := func(calls []testdriver.Call) bool {
			for _, c := range calls {
				if c.Method == testdriver.MethodGetCapacity && !c.Done() {
					return true
				}
			}
			return false
		}
		if err := w.driver.WaitFor(ctx, inFlight); err != nil {
			t.Fatal(err)
		}
		// The storage changes while the call runs; then SIGTERM, as the tracker sees it.
		w.driver.SetCapacityRules([]testdriver.CapacityRule{{AvailableCapacity: 42}})
		w.stop()
		<-w.done
		if got := w.capacities()[key]; got != 42 {
			t.Errorf("capacity %d after run returned, want 42: the answer of the call in flight", got)
		}
		for _, c := range w.driver.Journal() {
			if c.Canceled || !c.CallerGone.IsZero() {
				t.Errorf("a call was abandoned: %+v", c)
			}
		}
	})
}

// partial is an object as the metadata client reads it.
func partial(apiVersion, kind, name string, uid types.UID, owner *metav1.OwnerReference) *metav1.PartialObjectMetadata {
	o := &metav1.PartialObjectMetadata{TypeMeta: metav1.TypeMeta{APIVersion: apiVersion, Kind: kind},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: capNS, UID: uid}}
	if kind == "WidgetPool" {
		o.Namespace = ""
	}
	if owner != nil {
		o.OwnerReferences = []metav1.OwnerReference{*owner}
	}
	return o
}

func controllerRef(apiVersion, kind, name string, uid types.UID) *metav1.OwnerReference {
	return &metav1.OwnerReference{APIVersion: apiVersion, Kind: kind, Name: name, UID: uid, Controller: ptr.To(true)}
}

// The owner walk follows controllers of any kind, as upstream's owner.Lookup: a
// Deployment's ReplicaSet, or an operator's custom resources (namespaced or not), read
// through the metadata client once discovery names their resource.
func TestTheCapacityOwnerIsFoundByWalkingControllersFromThePod(t *testing.T) {
	mapper := meta.NewDefaultRESTMapper(nil)
	mapper.Add(schema.GroupVersionKind{Group: "apps", Version: "v1", Kind: "ReplicaSet"}, meta.RESTScopeNamespace)
	mapper.Add(schema.GroupVersionKind{Group: "apps", Version: "v1", Kind: "Deployment"}, meta.RESTScopeNamespace)
	mapper.Add(schema.GroupVersionKind{Group: "example.com", Version: "v1", Kind: "Widget"}, meta.RESTScopeNamespace)
	mapper.Add(schema.GroupVersionKind{Group: "example.com", Version: "v1", Kind: "WidgetPool"}, meta.RESTScopeRoot)
	scheme := metadatafake.NewTestScheme()
	if err := metav1.AddMetaToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	owners := &OwnerReader{mapper: mapper, metadata: metadatafake.NewSimpleMetadataClient(scheme,
		partial("apps/v1", "ReplicaSet", "csi-1", "rs", controllerRef("apps/v1", "Deployment", "csi", "dep")),
		partial("apps/v1", "Deployment", "csi", "dep", nil),
		partial("example.com/v1", "Widget", "w", "widget", controllerRef("example.com/v1", "WidgetPool", "pool", "pool")),
		partial("example.com/v1", "WidgetPool", "pool", "pool", nil),
		partial("apps/v1", "ReplicaSet", "stale", "new-uid", nil),
	)}
	pod := func(name string, owner *metav1.OwnerReference) *v1.Pod {
		p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: capNS, UID: types.UID(name)}}
		if owner != nil {
			p.OwnerReferences = []metav1.OwnerReference{*owner}
		}
		return p
	}
	kube := fake.NewClientset(
		pod("csi-1-x", controllerRef("apps/v1", "ReplicaSet", "csi-1", "rs")),
		pod("widget-x", controllerRef("example.com/v1", "Widget", "w", "widget")),
		pod("gadget-x", controllerRef("example.com/v1", "Gadget", "g", "gadget")),
		pod("stale-x", controllerRef("apps/v1", "ReplicaSet", "stale", "old-uid")),
	)
	for _, tc := range []struct {
		pod     string
		level   int
		want    *metav1.OwnerReference
		wantErr string
	}{
		{pod: "csi-1-x", level: 0, want: controllerRef("v1", "Pod", "csi-1-x", "csi-1-x")},
		{pod: "csi-1-x", level: 1, want: controllerRef("apps/v1", "ReplicaSet", "csi-1", "rs")},
		{pod: "csi-1-x", level: 2, want: controllerRef("apps/v1", "Deployment", "csi", "dep")},
		{pod: "csi-1-x", level: 3, wantErr: "no controller"},
		{pod: "widget-x", level: 1, want: controllerRef("example.com/v1", "Widget", "w", "widget")},
		{pod: "widget-x", level: 2, want: controllerRef("example.com/v1", "WidgetPool", "pool", "pool")},
		// One level needs no read of the owner, whatever its kind (upstream's shortcut).
		{pod: "gadget-x", level: 1, want: controllerRef("example.com/v1", "Gadget", "g", "gadget")},
		{pod: "gadget-x", level: 2, wantErr: "finding the resource of kind"},
		{pod: "stale-x", level: 2, wantErr: "has UID new-uid"},
		{pod: "missing", level: 0, wantErr: "POD_NAME"},
	} {
		ref, err := LookupOwner(context.Background(), kube, owners, capNS, tc.pod, tc.level)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s level %d: %+v, %v; want an error with %q", tc.pod, tc.level, ref, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s level %d: %v", tc.pod, tc.level, err)
			continue
		}
		if diff := cmp.Diff(tc.want, ref); diff != "" {
			t.Errorf("%s level %d: owner (-want +got):\n%s", tc.pod, tc.level, diff)
		}
	}
}

func TestManagedByNamesTheNodeAsUpstreamDoes(t *testing.T) {
	if got := ManagedByFor(""); got != "external-provisioner" {
		t.Errorf("central: %q", got)
	}
	node := func(n int) string { return "node" + strings.Repeat("a", n) }
	// The values upstream's external-provisioner computes (its cmd/csi-provisioner tests):
	// objects of a node deployment must keep their label across a rolling upgrade (P9).
	for _, tc := range []struct {
		name, base, node, want string
	}{
		{"short", "external-provisioner", "node01", "external-provisioner-node01"},
		{"no base", "", "node01", "node01"},
		{"exactly 63", "external-provisioner", node(38), "external-provisioner-" + node(38)},
		{"one over", "external-provisioner", node(39), "external-p-53f40b57-" + node(39)},
		{"node of 52", "external-provisioner", node(48), "e-53f40b57-" + node(48)},
		{"node of 53, node dropped", "external-provisioner", node(49), "external-provisioner-a3607ff1"},
		{"very long, node dropped", "external-provisioner", node(63), "external-provisioner-df38e37f"},
		{"very long, no base", "", node(63), "fa65587e"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := boundedName(tc.base, tc.node, 63)
			if got != tc.want {
				t.Errorf("boundedName(%q, %q, 63) = %q, want %q", tc.base, tc.node, got, tc.want)
			}
			if tc.base == capacityManagedBy {
				if m := ManagedByFor(tc.node); m != tc.want {
					t.Errorf("ManagedByFor(%q) = %q, want %q", tc.node, m, tc.want)
				}
			}
		})
	}
}

// driftingCapacity answers GetCapacity after latency with a value that changes on every
// call, as a busy backend's free space does, and counts the calls.
type driftingCapacity struct {
	latency time.Duration
	calls   atomic.Int64
}

func (d *driftingCapacity) GetCapacity(context.Context, *csi.GetCapacityRequest, ...grpc.CallOption) (*csi.GetCapacityResponse, error) {
	time.Sleep(d.latency)
	return &csi.GetCapacityResponse{AvailableCapacity: 1000 + d.calls.Add(1)}, nil
}

func TestTheEventsOfItsOwnWritesDoNotMakeTheTrackerPollAgain(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		drift := &driftingCapacity{latency: time.Millisecond}
		w := newCapacityWorld(t, testdriver.Config{Topology: true}, func(c *Config) { c.CSI = drift },
			append(topologyObjects("n1", "n2"), lateClass("fast", nil))...)
		w.waitFor("both objects", func() bool { return len(w.capacities()) == 2 })
		// A write stream (each event of a write asking for another GetCapacity) would make
		// a call every millisecond of the fake clock; the poll interval is an hour.
		const window = time.Second
		time.Sleep(window)
		synctest.Wait()
		calls := drift.calls.Load()
		updates := 0
		for _, a := range w.kube.Actions() {
			if a.GetVerb() == "update" && a.GetResource().Resource == "csistoragecapacities" {
				updates++
			}
		}
		t.Logf("FIGURE 2 objects, poll interval 1h, %v after creation: %d GetCapacity, %d updates", window, calls, updates)
		// One call per object, and a few more at most (the first recompute races the events).
		if calls > 4 || updates > 2 {
			t.Errorf("%d GetCapacity and %d updates for 2 objects in %v with a 1h poll interval: want about one call per object", calls, updates, window)
		}
	})
}

func TestACapacityChangedBySomeoneElseIsRepaired(t *testing.T) {
	w := newCapacityWorld(t, testdriver.Config{Topology: true, TotalCapacity: 5000}, nil,
		append(topologyObjects("n1"), lateClass("fast", nil))...)
	key := "fast@" + testdriver.TopologyKey + "=n1"
	w.waitFor("the object", func() bool { return w.capacities()[key] == 5000 })
	o := w.objects()[key]
	o.Capacity = resource.NewQuantity(1, resource.BinarySI)
	if _, err := w.kube.StorageV1().CSIStorageCapacities(capNS).Update(context.Background(), &o, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the capacity repaired", func() bool { return w.capacities()[key] == 5000 })
}

// Someone else writes the object while the tracker asks GetCapacity, after it read the
// object: its update, carrying the version it read, conflicts. The key goes back to the
// queue (no GET, no retry loop), and after the backoff the tracker writes from the newer
// copy: the object holds the driver's answer and keeps the other writer's change.
func TestAConflictingWriteGoesBackToTheQueueAndTheObjectEndsUpRight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		w := newCapacityWorld(t, testdriver.Config{Topology: true, TotalCapacity: 5000}, nil,
			append(topologyObjects("n1"), lateClass("fast", nil))...)
		key := "fast@" + testdriver.TopologyKey + "=n1"
		w.waitFor("the object", func() bool { return w.capacities()[key] == 5000 })

		// The sync of the test starts once the tracker is idle (the first poll may sync the
		// key again), and its GetCapacity is the one started after that.
		// On the fake clock: the other write lands while the call runs.
		w.driver.SetMethodLatency(testdriver.MethodGetCapacity, 3*time.Second)
		w.waitFor("the tracker idle", func() bool {
			w.tracker.mu.Lock()
			defer w.tracker.mu.Unlock()
			return w.tracker.queue.Len() == 0 && len(w.tracker.syncing) == 0
		})
		w.driver.SetCapacityRules([]testdriver.CapacityRule{{AvailableCapacity: 42}})
		armed := time.Now()
		w.tracker.queue.Add(capacityKey{class: "fast", segment: testdriver.TopologyKey + "=n1"})
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := w.driver.WaitFor(ctx, func(calls []testdriver.Call) bool {
			return slices.ContainsFunc(calls, func(c testdriver.Call) bool {
				return c.Method == testdriver.MethodGetCapacity && !c.Done() && !c.Start.Before(armed)
			})
		}); err != nil {
			t.Fatal(err)
		}
		w.driver.SetMethodLatency(testdriver.MethodGetCapacity, 0)
		o := w.objects()[key]
		o.Annotations = map[string]string{"example.com/by": "someone else"}
		if _, err := w.kube.StorageV1().CSIStorageCapacities(capNS).Update(context.Background(), &o, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}

		w.waitFor("the driver's answer written", func() bool { return w.capacities()[key] == 42 })
		if got := w.objects()[key].Annotations["example.com/by"]; got != "someone else" {
			t.Errorf("the other writer's annotation is %q after the tracker's write, want it kept", got)
		}
		// One at least: the tracker's update from the copy it read before the other write
		// (more while the informer has not shown that write after a backoff).
		if n := w.conflicts.Load(); n < 1 {
			t.Errorf("no conflict: the tracker's update did not carry the version it read")
		}
		for _, a := range w.kube.Actions() {
			if a.GetVerb() == "get" && a.GetResource().Resource == "csistoragecapacities" {
				t.Errorf("the tracker read an object for its write: %v", a)
			}
		}
		if n := len(w.objects()); n != 1 {
			t.Errorf("%d objects, want 1:\n%s", n, w.describe())
		}
	})
}

// segmentsAsked answers GetCapacity with a fixed value and records the segments asked for.
type segmentsAsked struct {
	mu    sync.Mutex
	asked []string
}

func (s *segmentsAsked) GetCapacity(_ context.Context, req *csi.GetCapacityRequest, _ ...grpc.CallOption) (*csi.GetCapacityResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.asked = append(s.asked, labels.Set(req.GetAccessibleTopology().GetSegments()).String())
	return &csi.GetCapacityResponse{AvailableCapacity: 100}, nil
}

func (s *segmentsAsked) count(segment string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, a := range s.asked {
		if a == segment {
			n++
		}
	}
	return n
}

func TestAProvisionedOrDeletedVolumeRefreshesTheCapacityOfItsSegmentAndClass(t *testing.T) {
	asked := &segmentsAsked{}
	w := newCapacityWorld(t, testdriver.Config{Topology: true}, func(c *Config) { c.CSI = asked },
		append(topologyObjects("n1", "n2"), lateClass("fast", nil), lateClass("slow", nil))...)
	w.waitFor("the objects", func() bool { return len(w.capacities()) == 4 })
	w.waitFor("the tracker idle", func() bool {
		w.tracker.mu.Lock()
		defer w.tracker.mu.Unlock()
		return w.tracker.queue.Len() == 0 && len(w.tracker.syncing) == 0
	})
	n1, n2 := testdriver.TopologyKey+"=n1", testdriver.TopologyKey+"=n2"
	before1, before2 := asked.count(n1), asked.count(n2)

	// A volume of class fast in n1: fast@n1 only (the poll interval is an hour).
	w.tracker.Refresh("fast", []*csi.Topology{{Segments: map[string]string{testdriver.TopologyKey: "n1"}}})
	w.waitFor("fast@n1 asked again", func() bool { return asked.count(n1) == before1+1 })
	// No topology (a failed provisioning): every segment of the class.
	w.tracker.Refresh("slow", nil)
	w.waitFor("slow asked again in both segments", func() bool { return asked.count(n1) == before1+2 && asked.count(n2) == before2+1 })
}

func TestInSegment(t *testing.T) {
	seg := map[string]string{"zone": "a", "rack": "1"}
	topo := func(m map[string]string) *csi.Topology { return &csi.Topology{Segments: m} }
	for _, tc := range []struct {
		name string
		topo []*csi.Topology
		want bool
	}{
		{"no topology: every segment", nil, true},
		{"same values", []*csi.Topology{topo(map[string]string{"zone": "a", "rack": "1"})}, true},
		{"one of several", []*csi.Topology{topo(map[string]string{"zone": "b", "rack": "1"}), topo(map[string]string{"zone": "a", "rack": "1"})}, true},
		{"another zone", []*csi.Topology{topo(map[string]string{"zone": "b", "rack": "1"})}, false},
		{"a key missing", []*csi.Topology{topo(map[string]string{"zone": "a"})}, false},
	} {
		if got := inSegment(seg, tc.topo); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// GetCapacity is asked as upstream's capacity controller asks: the class's parameters, the
// segment, and no volume capability (no placeholder with an UNKNOWN access mode).
func TestGetCapacityRequestIsUpstreams(t *testing.T) {
	sc := class("fast", func(sc *storagev1.StorageClass) { sc.Parameters["csi.storage.k8s.io/fstype"] = "xfs" })
	for _, tc := range []struct {
		name    string
		segment map[string]string
		want    *csi.GetCapacityRequest
	}{
		{"a segment", map[string]string{"zone": "a"}, &csi.GetCapacityRequest{Parameters: sc.Parameters, AccessibleTopology: &csi.Topology{Segments: map[string]string{"zone": "a"}}}},
		{"no topology", map[string]string{}, &csi.GetCapacityRequest{Parameters: sc.Parameters}},
	} {
		if diff := cmp.Diff(tc.want, getCapacityRequest(sc, tc.segment), protocmp.Transform()); diff != "" {
			t.Errorf("%s: request (-want +got):\n%s", tc.name, diff)
		}
	}
}

const drv = "drv.example.com"

func class(name string, change func(*storagev1.StorageClass)) *storagev1.StorageClass {
	return objects.Class(drv, name, change)
}
