package realloop

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cluster"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// stageTimeout bounds each wait for a stage of every Pod.
const stageTimeout = 60 * time.Second

// fastParameters are the mutable parameters of every workload's VolumeAttributesClass,
// which claims are modified to while in use: keys the test driver accepts in
// ControllerModifyVolume.
func fastParameters() map[string]string { return map[string]string{"iops": "5000"} }

// world is one test's cluster: its scenario (namespace, test CSI driver), the real control
// loop with its fake nodes, one replica of each sidecar and the workload.
type world struct {
	*e2e.Scenario
	impl                           implementation
	cluster                        *cluster.Cluster
	work                           *cluster.Workload
	provisioner, attacher, resizer *e2e.Replica
}

// implementation is the three sidecars a world runs: csi-sidecars' or upstream's.
type implementation struct {
	name string // csi-sidecars, upstream
	// binaries are upstream's binaries by sidecar; nil for csi-sidecars.
	binaries map[string]string
}

// ours runs `csi-sidecars <sidecar>`, one process per sidecar.
var ours = implementation{name: "csi-sidecars"}

func (im implementation) upstream() bool { return im.binaries != nil }

// start runs the implementation's sidecar with its default flags and the harness's shared
// ones (socket, kubeconfig, leader election in the scenario's namespace, diagnostics).
func (im implementation) start(s *e2e.Scenario, sidecar string) *e2e.Replica {
	if im.upstream() {
		return s.StartUpstream(sidecar, im.binaries[sidecar])
	}
	return s.Start(sidecar, []string{"csi-sidecars", sidecar})
}

// newWorld starts the control loop with n nodes, whose driver node IDs differ from their
// names (so a sidecar that confused the two would publish to a node the driver does not
// know), and the implementation's three sidecars, each with upstream's default flags.
func newWorld(t testing.TB, nodes int, impl implementation) *world {
	t.Helper()
	w := newLoop(t, nodes, impl, func(w *world) {
		w.provisioner = impl.start(w.Scenario, "provisioner")
		w.attacher = impl.start(w.Scenario, "attacher")
		w.resizer = impl.start(w.Scenario, "resizer")
	})
	w.waitLeading()
	return w
}

// newLoop is newWorld's world without its sidecars: the scenario, the control loop and the
// workload. startSidecars runs once the scenario exists and before the control loop
// starts, so that the sidecars' start-up overlaps the control loop's.
func newLoop(t testing.TB, nodes int, impl implementation, startSidecars func(*world)) *world {
	t.Helper()
	if noLoop != nil {
		t.Skipf("no real control loop: %v", noLoop)
	}
	cp := kube.Get(t)
	e2e.RequireBinaries(t, binDir)
	assets, err := cluster.Assets()
	if err != nil {
		t.Fatal(err)
	}
	s := e2e.NewScenario(t, cp, binDir, testdriver.Config{Topology: true, Latency: 20 * time.Millisecond})
	w := &world{Scenario: s, impl: impl}
	startSidecars(w)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	began := time.Now()
	w.cluster, err = cluster.Start(ctx, cp, cluster.Options{
		AssetsDir:   assets,
		Nodes:       nodes,
		NodePrefix:  s.Namespace,
		Driver:      s.Driver.DriverName(),
		NodeID:      func(node string) string { return node + "-id" },
		TopologyKey: testdriver.TopologyKey,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := w.cluster.Stop(); err != nil {
			t.Errorf("stopping the control loop: %v", err)
		}
	})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("--- the control loop ---\n%s", w.cluster.Diagnostics())
		}
	})
	t.Logf("kube-controller-manager and kube-scheduler serving, %d nodes schedulable, after %v", nodes, time.Since(began).Round(time.Millisecond))
	w.work, err = cluster.NewWorkload(ctx, s.Client, cluster.WorkloadOptions{Namespace: s.Namespace, Driver: s.Driver.DriverName(),
		AttributesClass: s.Namespace + "-fast", AttributesParameters: fastParameters()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.work.Close)
	return w
}

// waitLeading waits until each sidecar leads. Ours also say on /readyz that their caches
// are synced; upstream's have no /readyz and start their informers once they lead.
func (w *world) waitLeading() {
	w.T.Helper()
	replicas := []*e2e.Replica{w.provisioner, w.attacher, w.resizer}
	w.WaitUntil("each sidecar holds its Lease", func() bool {
		for _, r := range replicas {
			if !r.Running() {
				w.T.Fatalf("%s exited with %d:\n%s", r.Name, r.ExitCode, r.Stderr())
			}
		}
		leases, err := w.Client.CoordinationV1().Leases(w.Namespace).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return false
		}
		held := 0
		for _, l := range leases.Items {
			if e2e.Holder(&l) != "" {
				held++
			}
		}
		return held >= len(replicas)
	})
	if !w.impl.upstream() {
		for _, r := range replicas {
			r.WaitReady(w.T)
		}
	}
}

// wait waits until the named Pods (all when none are named) reached stage.
func (w *world) wait(stage cluster.Stage, names ...string) {
	w.T.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), stageTimeout)
	defer cancel()
	if err := w.work.Wait(ctx, stage, names...); err != nil {
		w.T.Fatalf("%v\nsidecars running: provisioner %v, attacher %v, resizer %v; control loop: %v",
			err, w.provisioner.Running(), w.attacher.Running(), w.resizer.Running(), w.cluster.Running())
	}
}

func (w *world) items(names []string) []cluster.Item {
	out := make([]cluster.Item, len(names))
	for i, name := range names {
		out[i], _ = w.work.Item(name)
	}
	return out
}

// calls counts the calls of method on replica r's socket by key, and reports any that did
// not succeed: no fault is injected, so each is a misbehaviour.
func (w *world) calls(r *e2e.Replica, method string, key func(testdriver.Call) string) map[string]int {
	w.T.Helper()
	out := map[string]int{}
	for _, c := range e2e.CallsOn(w.Driver.Journal(), r, method) {
		if c.Code != "OK" || c.Canceled {
			w.T.Errorf("%s %s on %s: code %s %q, cancelled %v", method, key(c), r.Name, c.Code, c.Message, c.Canceled)
			continue
		}
		out[key(c)]++
	}
	return out
}

func byVolume(c testdriver.Call) string         { return c.VolumeID }
func byVolumeOnNode(c testdriver.Call) string   { return c.VolumeID + " on " + c.NodeID }
func byRequestedName(c testdriver.Call) string  { return c.VolumeName }
func attachedName(driver, handle string) string { return "kubernetes.io/csi/" + driver + "^" + handle }

// exactlyOnce checks that each key was called once.
func (w *world) exactlyOnce(method string, counts map[string]int, keys []string) {
	w.T.Helper()
	for _, k := range keys {
		if n := counts[k]; n != 1 {
			w.T.Errorf("%s for %s succeeded %d times, want once", method, k, n)
		}
	}
}

// reportedAttached is each node's status.volumesAttached, by node.
func (w *world) reportedAttached() map[string][]string {
	w.T.Helper()
	out := map[string][]string{}
	for _, node := range w.cluster.Nodes() {
		n, err := w.Client.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
		if err != nil {
			w.T.Fatal(err)
		}
		for _, v := range n.Status.VolumesAttached {
			out[node] = append(out[node], string(v.Name))
		}
	}
	return out
}

// checkNodesAlive checks that the fake nodes' heartbeats kept them Ready and untainted: the
// Ready condition and the node Lease renewed within the last few heartbeats.
func (w *world) checkNodesAlive() {
	w.T.Helper()
	ctx := context.Background()
	const fresh = 10 * time.Second // heartbeats come every 2 s
	for _, name := range w.cluster.Nodes() {
		node, err := w.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			w.T.Fatal(err)
		}
		ready := false
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				ready = c.Status == corev1.ConditionTrue && time.Since(c.LastHeartbeatTime.Time) < fresh
			}
		}
		if !ready || len(node.Spec.Taints) != 0 {
			w.T.Errorf("node %s: conditions %+v, taints %+v; want Ready with a heartbeat in the last %v, no taints", name, node.Status.Conditions, node.Spec.Taints, fresh)
		}
		lease, err := w.Client.CoordinationV1().Leases("kube-node-lease").Get(ctx, name, metav1.GetOptions{})
		if err != nil || lease.Spec.RenewTime == nil || time.Since(lease.Spec.RenewTime.Time) >= fresh {
			w.T.Errorf("node %s Lease not renewed in the last %v: %+v, %v", name, fresh, lease, err)
		}
	}
}

// Ten Pods, each with a new WaitForFirstConsumer claim, go through their whole life under a
// real kube-controller-manager and kube-scheduler with three nodes: scheduled, their
// volumes provisioned on the chosen node, bound, attached to that node, half of them grown
// and the other half given a new VolumeAttributesClass while in use, the Pods deleted and
// the volumes detached, the claims deleted and the volumes deleted. Every driver call of
// the three sidecars succeeds exactly once per volume (or volume and node).
func TestPodsWithClaimsLiveTheirWholeLifeUnderTheRealControlLoop(t *testing.T) {
	began := time.Now()
	w := runLife(t, 10, 3, ours)
	t.Logf("FIGURE real control loop, %d Pods on %d nodes, stage spans:\n%s", len(w.work.Names()), len(w.cluster.Nodes()), cluster.FormatSummary(w.work.Summary()))
	t.Logf("FIGURE real control loop: whole test %v", time.Since(began).Round(time.Millisecond))
}

// runLife takes pods Pods through their life on a new world of nodes nodes, checking each
// step, and returns the world for its figures.
func runLife(t testing.TB, pods, nodes int, impl implementation) *world {
	w := newWorld(t, nodes, impl)
	ctx := context.Background()
	driver := w.Driver.DriverName()
	names := make([]string, pods)
	for i := range names {
		names[i] = fmt.Sprintf("app-%02d", i)
		if err := w.work.CreatePod(ctx, names[i]); err != nil {
			t.Fatal(err)
		}
	}

	// Scheduled, provisioned on the chosen node, bound, attached there.
	w.wait(cluster.Attached)
	items := w.items(names)
	perNode := map[string]int{}
	var pvNames, handles, publications []string
	for _, it := range items {
		perNode[it.Node]++
		nodeID := w.cluster.NodeID(it.Node)
		if nodeID == "" {
			t.Errorf("Pod %s was scheduled to %q, not one of the cluster's nodes %v", it.Name, it.Node, w.cluster.Nodes())
			continue
		}
		pvNames, handles = append(pvNames, it.PersistentVolume), append(handles, it.VolumeHandle)
		publications = append(publications, it.VolumeHandle+" on "+nodeID)
		pv, err := w.Client.CoreV1().PersistentVolumes().Get(ctx, it.PersistentVolume, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if ref := pv.Spec.ClaimRef; ref == nil || ref.Name != it.Name || ref.UID != it.ClaimUID {
			t.Errorf("PV %s: claimRef %+v, want claim %s (%s)", pv.Name, ref, it.Name, it.ClaimUID)
		}
		if a := pv.Spec.NodeAffinity; a == nil || a.Required == nil || len(a.Required.NodeSelectorTerms) != 1 ||
			len(a.Required.NodeSelectorTerms[0].MatchExpressions) != 1 ||
			a.Required.NodeSelectorTerms[0].MatchExpressions[0].Key != testdriver.TopologyKey ||
			!slices.Equal(a.Required.NodeSelectorTerms[0].MatchExpressions[0].Values, []string{nodeID}) {
			t.Errorf("PV %s of Pod %s on %s: node affinity %+v, want %s=%s", pv.Name, it.Name, it.Node, a, testdriver.TopologyKey, nodeID)
		}
		if v, ok := w.Driver.Volume(it.VolumeHandle); !ok || !slices.Equal(mapKeys(v.Published), []string{nodeID}) {
			t.Errorf("volume %s of Pod %s: in driver %v, published to %v; want published to %s", it.VolumeHandle, it.Name, ok, mapKeys(v.Published), nodeID)
		}
	}
	t.Logf("Pods per node: %v", perNode)
	w.exactlyOnce("CreateVolume", w.calls(w.provisioner, testdriver.MethodCreateVolume, byRequestedName), pvNames)
	w.exactlyOnce("ControllerPublishVolume", w.calls(w.attacher, testdriver.MethodControllerPublishVolume, byVolumeOnNode), publications)
	// The attach-detach controller reports the attachments in the nodes' status; the fake
	// nodes' heartbeats must leave that alone.
	w.WaitUntil("every volume reported attached in its node's status", func() bool {
		reported := w.reportedAttached()
		for _, it := range items {
			if !slices.Contains(reported[it.Node], attachedName(driver, it.VolumeHandle)) {
				return false
			}
		}
		return true
	})

	// Half the claims grow while their Pods use them.
	var grown, grownHandles []string
	for i, it := range items {
		if i%2 == 0 {
			grown, grownHandles = append(grown, it.Name), append(grownHandles, it.VolumeHandle)
			if err := w.work.Grow(ctx, it.Name, "2Gi"); err != nil {
				t.Fatal(err)
			}
		}
	}
	w.wait(cluster.Grown, grown...)
	expanded := w.calls(w.resizer, testdriver.MethodControllerExpandVolume, byVolume)
	w.exactlyOnce("ControllerExpandVolume", expanded, grownHandles)
	twoGi := resource.MustParse("2Gi")
	for i, it := range items {
		want := resource.MustParse("1Gi")
		if i%2 == 0 {
			want = twoGi
		} else if expanded[it.VolumeHandle] != 0 {
			t.Errorf("ControllerExpandVolume was called for %s of claim %s, which was not grown", it.VolumeHandle, it.Name)
		}
		pv, err := w.Client.CoreV1().PersistentVolumes().Get(ctx, it.PersistentVolume, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		claim, err := w.Client.CoreV1().PersistentVolumeClaims(w.Namespace).Get(ctx, it.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		pvSize, claimSize := pv.Spec.Capacity[corev1.ResourceStorage], claim.Status.Capacity[corev1.ResourceStorage]
		v, _ := w.Driver.Volume(it.VolumeHandle)
		if pvSize.Cmp(want) != 0 || claimSize.Cmp(want) != 0 || v.CapacityBytes != want.Value() {
			t.Errorf("claim %s: PV capacity %s, claim status capacity %s, driver %d bytes; want %s", it.Name, pvSize.String(), claimSize.String(), v.CapacityBytes, want.String())
		}
	}
	// The other half are modified while in use: a new VolumeAttributesClass, which the
	// resizer applies with ControllerModifyVolume and records as the claim's current class
	// and the PV's.
	class := w.work.AttributesClass()
	var modified, modifiedHandles []string
	for i, it := range items {
		if i%2 == 1 {
			modified, modifiedHandles = append(modified, it.Name), append(modifiedHandles, it.VolumeHandle)
			if err := w.work.Modify(ctx, it.Name, class); err != nil {
				t.Fatal(err)
			}
		}
	}
	w.wait(cluster.Modified, modified...)
	modifyCalls := w.calls(w.resizer, testdriver.MethodControllerModifyVolume, byVolume)
	w.exactlyOnce("ControllerModifyVolume", modifyCalls, modifiedHandles)
	for i, it := range items {
		pv, err := w.Client.CoreV1().PersistentVolumes().Get(ctx, it.PersistentVolume, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		claim, err := w.Client.CoreV1().PersistentVolumeClaims(w.Namespace).Get(ctx, it.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		v, _ := w.Driver.Volume(it.VolumeHandle)
		if i%2 == 0 {
			if modifyCalls[it.VolumeHandle] != 0 || claim.Status.CurrentVolumeAttributesClassName != nil || len(v.MutableParameters) != 0 {
				t.Errorf("claim %s, not modified: %d ControllerModifyVolume calls, current class %v, driver's parameters %v; want none",
					it.Name, modifyCalls[it.VolumeHandle], claim.Status.CurrentVolumeAttributesClassName, v.MutableParameters)
			}
			continue
		}
		current := claim.Status.CurrentVolumeAttributesClassName
		if current == nil || *current != class || claim.Status.ModifyVolumeStatus != nil ||
			pv.Spec.VolumeAttributesClassName == nil || *pv.Spec.VolumeAttributesClassName != class ||
			!maps.Equal(v.MutableParameters, fastParameters()) {
			t.Errorf("claim %s modified to %s: current class %v, modify status %+v, PV's class %v, driver's parameters %v; want %s everywhere, parameters %v",
				it.Name, class, current, claim.Status.ModifyVolumeStatus, pv.Spec.VolumeAttributesClassName, v.MutableParameters, class, fastParameters())
		}
	}

	// Seconds of heartbeats later, the nodes' status still lists every attachment.
	reported := w.reportedAttached()
	for _, it := range items {
		if !slices.Contains(reported[it.Node], attachedName(driver, it.VolumeHandle)) {
			t.Errorf("node %s no longer reports volume %s of Pod %s attached: %v", it.Node, it.VolumeHandle, it.Name, reported[it.Node])
		}
	}

	// The Pods go; their volumes are detached.
	for _, name := range names {
		if err := w.work.DeletePod(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	w.wait(cluster.Detached)
	w.exactlyOnce("ControllerUnpublishVolume", w.calls(w.attacher, testdriver.MethodControllerUnpublishVolume, byVolumeOnNode), publications)
	for _, it := range items {
		if v, ok := w.Driver.Volume(it.VolumeHandle); !ok || len(v.Published) != 0 {
			t.Errorf("volume %s of Pod %s: in driver %v, still published to %v", it.VolumeHandle, it.Name, ok, mapKeys(v.Published))
		}
	}
	w.WaitUntil("no detached volume reported attached in a node's status", func() bool {
		for _, vs := range w.reportedAttached() {
			if len(vs) > 0 {
				return false
			}
		}
		return true
	})

	// The claims go; their volumes are deleted.
	for _, name := range names {
		if err := w.work.DeleteClaim(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	w.wait(cluster.VolumeDeleted)
	w.exactlyOnce("DeleteVolume", w.calls(w.provisioner, testdriver.MethodDeleteVolume, byVolume), handles)
	if vs := w.Driver.Volumes(); len(vs) != 0 {
		t.Errorf("%d volumes left in the driver: %+v", len(vs), vs)
	}
	if o := w.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("%d overlapping operations: %+v", len(o), o)
	}
	for _, r := range []*e2e.Replica{w.provisioner, w.attacher, w.resizer} {
		if !r.Running() {
			t.Errorf("%s exited with %d", r.Name, r.ExitCode)
		}
	}
	if err := w.cluster.Running(); err != nil {
		t.Error(err)
	}
	w.checkNodesAlive()
	e2e.NoForbidden(t, w.provisioner, w.attacher, w.resizer)
	// Counted again at the end: a call repeated after its stage was counted (the retry of
	// a write that failed to record it, a sync from a cache that did not show it yet)
	// fails the test too. The expansions were counted seconds ago.
	w.exactlyOnce("ControllerExpandVolume", w.calls(w.resizer, testdriver.MethodControllerExpandVolume, byVolume), grownHandles)
	w.exactlyOnce("ControllerModifyVolume", w.calls(w.resizer, testdriver.MethodControllerModifyVolume, byVolume), modifiedHandles)
	w.exactlyOnce("DeleteVolume", w.calls(w.provisioner, testdriver.MethodDeleteVolume, byVolume), handles)
	return w
}

func mapKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
