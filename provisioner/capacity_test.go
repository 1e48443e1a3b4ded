package provisioner

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/component-base/metrics"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testdriver"
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
		sc.Provisioner = "other.csi.test"
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
	tracker  *capacityTracker
	registry metrics.KubeRegistry
	stop     context.CancelFunc
	done     chan struct{}
}

func newCapacityWorld(t *testing.T, dcfg testdriver.Config, change func(*capacityConfig), objects ...runtime.Object) *capacityWorld {
	t.Helper()
	dcfg.DriverName = drv
	b, err := testdriver.New(dcfg)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := b.Serve(filepath.Join(t.TempDir(), "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(srv.Endpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
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
	cfg := capacityConfig{
		driver: drv, namespace: capNS, managedBy: capacityManagedBy,
		pollInterval: time.Hour, timeout: 5 * time.Second, threads: 2,
		csi: csi.NewControllerClient(conn), kube: w.kube, ops: context.Background(),
	}
	if change != nil {
		change(&cfg)
	}
	factory := informers.NewSharedInformerFactory(w.kube, 0)
	if w.tracker, err = newCapacityTracker(cfg, factory, 20*time.Millisecond, 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := w.registry.CustomRegister(newCapacityCollector(w.tracker)); err != nil {
		t.Fatal(err)
	}
	stopInformers := make(chan struct{})
	factory.Start(stopInformers)
	w.tracker.start(stopInformers)
	intake, stop := context.WithCancel(context.Background())
	w.stop = stop
	go func() {
		defer close(w.done)
		w.tracker.run(intake)
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
	w := newCapacityWorld(t, testdriver.Config{Topology: true, CapacityRules: rules}, func(c *capacityConfig) {
		c.owner = owner
		c.pollInterval = 50 * time.Millisecond
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
		if c.Method == testdriver.MethodGetCapacity && c.Code != "OK" {
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

	families, err := w.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		if strings.HasPrefix(f.GetName(), "csistoragecapacities_") && len(f.GetMetric()) == 1 {
			got[f.GetName()] = f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	wantMetrics := map[string]float64{"csistoragecapacities_desired_goal": 1, "csistoragecapacities_desired_current": 1, "csistoragecapacities_obsolete": 0}
	if diff := cmp.Diff(wantMetrics, got); diff != "" {
		t.Errorf("metrics (-want +got):\n%s", diff)
	}
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
	w := newCapacityWorld(t, testdriver.Config{Topology: true, TotalCapacity: 5000}, func(c *capacityConfig) {
		c.nodeSegment = map[string]string{testdriver.TopologyKey: "n1"}
		c.managedBy = capacityManagedByFor("n1")
	}, append(topologyObjects("n1", "n2"), lateClass("fast", nil))...)
	w.waitFor("the node's object", func() bool { return len(w.objects()) == 1 })
	o := w.objects()["fast@"+testdriver.TopologyKey+"=n1"]
	if o.Labels[capacityManagedByLabel] != "external-provisioner-n1" {
		t.Errorf("managed-by %q, want external-provisioner-n1:\n%s", o.Labels[capacityManagedByLabel], w.describe())
	}
}

func TestAGetCapacityInFlightWhenIntakeEndsFinishesAndItsWriteLands(t *testing.T) {
	w := newCapacityWorld(t, testdriver.Config{Topology: true, TotalCapacity: 5000}, func(c *capacityConfig) { c.threads = 1 },
		append(topologyObjects("n1"), lateClass("fast", nil))...)
	key := "fast@" + testdriver.TopologyKey + "=n1"
	w.waitFor("the object", func() bool { return w.capacities()[key] == 5000 })

	w.driver.SetMethodLatency(testdriver.MethodGetCapacity, 300*time.Millisecond)
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
}

func TestTheCapacityOwnerIsFoundByWalkingControllersFromThePod(t *testing.T) {
	dep := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "csi", Namespace: capNS, UID: "dep"}}
	rs := &appsv1.ReplicaSet{ObjectMeta: metav1.ObjectMeta{Name: "csi-1", Namespace: capNS, UID: "rs",
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "Deployment", Name: "csi", UID: "dep", Controller: ptr.To(true)}}}}
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "csi-1-x", Namespace: capNS, UID: "pod",
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "csi-1", UID: "rs", Controller: ptr.To(true)}}}}
	kube := fake.NewClientset(dep, rs, pod)
	for level, want := range []types.UID{"pod", "rs", "dep"} {
		ref, err := lookupCapacityOwner(context.Background(), kube, capNS, "csi-1-x", level)
		if err != nil || ref.UID != want || ref.Controller == nil || !*ref.Controller {
			t.Errorf("level %d: %+v, %v; want owner %s", level, ref, err, want)
		}
	}
	if _, err := lookupCapacityOwner(context.Background(), kube, capNS, "csi-1-x", 3); err == nil || !strings.Contains(err.Error(), "no controller") {
		t.Errorf("level 3: %v, want an error saying the Deployment has no controller", err)
	}
	if _, err := lookupCapacityOwner(context.Background(), kube, capNS, "missing", 0); err == nil || !strings.Contains(err.Error(), "POD_NAME") {
		t.Errorf("missing pod: %v, want an error naming POD_NAME", err)
	}
}

func TestManagedByNamesTheNodeAndStaysAValidLabelValue(t *testing.T) {
	if got := capacityManagedByFor(""); got != "external-provisioner" {
		t.Errorf("central: %q", got)
	}
	if got := capacityManagedByFor("node-1"); got != "external-provisioner-node-1" {
		t.Errorf("node: %q", got)
	}
	long := strings.Repeat("n", 80)
	a, b := capacityManagedByFor(long), capacityManagedByFor(long+"x")
	if len(a) > 63 || a == b {
		t.Errorf("long node names: %q (%d), %q: want distinct values of at most 63 characters", a, len(a), b)
	}
}

func TestCapacityFlagsNeedTheirEnvironment(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
	}{
		{"namespace missing", []string{"--enable-capacity"}, map[string]string{"POD_NAME": "p"}, "NAMESPACE"},
		{"pod missing for an owner", []string{"--enable-capacity"}, map[string]string{"NAMESPACE": "ns"}, "POD_NAME"},
		{"no owner needs no pod", []string{"--enable-capacity", "--capacity-ownerref-level=-1"}, map[string]string{"NAMESPACE": "ns"}, ""},
		{"older upstream's POD_NAMESPACE", []string{"--enable-capacity", "--capacity-ownerref-level=0"}, map[string]string{"POD_NAMESPACE": "ns", "POD_NAME": "p"}, ""},
		{"poll interval", []string{"--enable-capacity", "--capacity-poll-interval=0"}, map[string]string{"NAMESPACE": "ns", "POD_NAME": "p"}, "--capacity-poll-interval"},
		{"threads", []string{"--enable-capacity", "--capacity-threads=0"}, map[string]string{"NAMESPACE": "ns", "POD_NAME": "p"}, "--capacity-threads"},
		{"capacity off needs nothing", nil, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var o options
			if err := newFlagSet(&o).Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			err := o.validate(func(k string) string { return tc.env[k] })
			if (tc.wantErr == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.wantErr)) {
				t.Errorf("validate: %v, want %q", err, tc.wantErr)
			}
		})
	}
}
