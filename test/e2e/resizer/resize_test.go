package resizer

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// 20 PVCs are resized; those whose driver answer asks for node expansion wait for the
// kubelet with the upstream fields, and once it has caught up the PV's pre-resize
// annotation goes (AnnotateFsResize, beta and on by default as in upstream v2.3.0).
func TestResizesTwentyPVCsSomeNeedingNodeExpansion(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	const n = 20
	var pairs []pair
	for i := range n {
		p := s.createPair(fmt.Sprintf("claim-%02d", i), "")
		if i%3 == 0 {
			s.Driver.SetNodeExpansionRequired(p.volumeID, true)
		}
		pairs = append(pairs, p)
	}
	a := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)
	counter := writeCounter{s}
	before := counter.writes()

	start := time.Now()
	for _, p := range pairs {
		s.request(p.name, "2Gi")
	}
	for i, p := range pairs {
		node := i%3 == 0
		s.WaitUntil(p.name+" resized", func() bool {
			pvc := s.pvc(p.name)
			if node {
				return resizeState(pvc) == v1.PersistentVolumeClaimNodeResizePending
			}
			return capacityOf(pvc) == "2Gi"
		})
	}
	elapsed := time.Since(start)
	writes := since(before, counter.writes())

	for i, p := range pairs {
		pvc, pv := s.pvc(p.name), s.pvObject(p.pv)
		if pvCapacity(pv) != "2Gi" {
			t.Errorf("%s: PV capacity %s, want 2Gi", p.name, pvCapacity(pv))
		}
		if a := pvc.Status.AllocatedResources[v1.ResourceStorage]; a.String() != "2Gi" {
			t.Errorf("%s: allocatedResources %s, want 2Gi", p.name, a.String())
		}
		if i%3 == 0 {
			if capacityOf(pvc) != "1Gi" || !hasCondition(pvc, v1.PersistentVolumeClaimFileSystemResizePending) || pv.Annotations["volume.alpha.kubernetes.io/pre-resize-capacity"] != "1Gi" {
				t.Errorf("%s: node expansion not handed off: capacity %s, conditions %+v, PV annotations %v", p.name, capacityOf(pvc), pvc.Status.Conditions, pv.Annotations)
			}
			continue
		}
		if pvc.Annotations["volume.kubernetes.io/node-expansion-not-required"] != "true" || pvc.Status.AllocatedResourceStatuses != nil || len(pvc.Status.Conditions) != 0 {
			t.Errorf("%s: not finished as upstream records it: annotations %v statuses %v conditions %+v", p.name, pvc.Annotations, pvc.Status.AllocatedResourceStatuses, pvc.Status.Conditions)
		}
	}
	for id, calls := range expandCalls(s.Driver.Journal()) {
		if len(calls) != 1 || calls[0].Code != "OK" {
			t.Errorf("volume %s: %d ControllerExpandVolume calls (%+v), want one OK", id, len(calls), calls)
		}
	}
	if got := len(expandCalls(s.Driver.Journal())); got != n {
		t.Errorf("%d volumes expanded, want %d", got, n)
	}
	if v, _ := s.Driver.Volume(pairs[1].volumeID); v.CapacityBytes != 2<<30 {
		t.Errorf("backend volume %d bytes, want 2Gi", v.CapacityBytes)
	}
	t.Logf("FIGURE resize: %d PVCs (%d needing node expansion) resized in %v", n, (n+2)/3, elapsed.Round(time.Millisecond))
	t.Logf("FIGURE resize API writes for %d PVCs: %v", n, writes)

	// Play the kubelet for the node expansions: the PVC reaches the PV's capacity.
	for i, p := range pairs {
		if i%3 != 0 {
			continue
		}
		pvc := s.pvc(p.name)
		pvc.Status.Capacity[v1.ResourceStorage] = resource.MustParse("2Gi")
		pvc.Status.Conditions = nil
		pvc.Status.AllocatedResourceStatuses = nil
		if _, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).UpdateStatus(context.Background(), pvc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for i, p := range pairs {
		if i%3 == 0 {
			s.WaitUntil(p.name+"'s PV loses its pre-resize-capacity annotation", func() bool {
				_, ok := s.pvObject(p.pv).Annotations["volume.alpha.kubernetes.io/pre-resize-capacity"]
				return !ok
			})
		}
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("overlapping operations: %+v", o)
	}
}

// A request the driver refuses is marked infeasible; lowering it (above the old capacity)
// recovers, as RecoverVolumeExpansionFailure promises.
func TestFailingExpansionThenLoweredRequest(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	p := s.createPair("claim", "")
	if err := s.Driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerExpandVolume, Volume: p.volumeID, Code: codes.OutOfRange, Times: 1}); err != nil {
		t.Fatal(err)
	}
	a := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	s.request(p.name, "100Gi")
	s.WaitUntil("the expansion is infeasible", func() bool {
		pvc := s.pvc(p.name)
		return resizeState(pvc) == v1.PersistentVolumeClaimControllerResizeInfeasible && hasCondition(pvc, v1.PersistentVolumeClaimControllerResizeError)
	})
	if c := pvCapacity(s.pvObject(p.pv)); c != "1Gi" {
		t.Errorf("PV capacity %s after a failed expansion, want 1Gi", c)
	}

	s.request(p.name, "3Gi")
	s.WaitUntil("the lowered request is expanded", func() bool { return capacityOf(s.pvc(p.name)) == "3Gi" })
	pvc := s.pvc(p.name)
	if a := pvc.Status.AllocatedResources[v1.ResourceStorage]; a.String() != "3Gi" || pvc.Status.AllocatedResourceStatuses != nil || hasCondition(pvc, v1.PersistentVolumeClaimControllerResizeError) {
		t.Errorf("after recovery: allocated %s, statuses %v, conditions %+v", a.String(), pvc.Status.AllocatedResourceStatuses, pvc.Status.Conditions)
	}
	calls := expandCalls(s.Driver.Journal())[p.volumeID]
	if len(calls) != 2 || calls[0].Code != "OutOfRange" || calls[1].Code != "OK" {
		t.Errorf("calls %+v, want OutOfRange then OK", calls)
	}
	if v, _ := s.Driver.Volume(p.volumeID); v.CapacityBytes != 3<<30 {
		t.Errorf("backend volume %d bytes, want 3Gi", v.CapacityBytes)
	}
	events, err := s.Client.CoreV1().Events(s.Namespace).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + p.name})
	if err != nil {
		t.Fatal(err)
	}
	reasons := map[string]bool{}
	for _, e := range events.Items {
		reasons[e.Reason] = true
	}
	for _, r := range []string{"Resizing", "VolumeResizeFailed", "VolumeResizeSuccessful"} {
		if !reasons[r] {
			t.Errorf("no %s event (got %v)", r, reasons)
		}
	}
}

// The kubelet's NodeResizeInfeasible, written after the controller handed a resize to the
// node, enqueues the PVC at once (not at the next resync, ten minutes away): the controller
// expands to the allocated size again and hands it back to the node (NodeResizePending), so
// the kubelet may retry, as upstream.
func TestNodeResizeInfeasibleIsAnsweredAtOnce(t *testing.T) {
	s := newScenario(t, testdriver.Config{NodeExpansionRequired: true})
	p := s.createPair("claim", "")
	a := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	s.request(p.name, "2Gi")
	s.WaitUntil("the resize is handed to the node", func() bool {
		return resizeState(s.pvc(p.name)) == v1.PersistentVolumeClaimNodeResizePending
	})
	// Play the kubelet: the file system cannot grow.
	pvc := s.pvc(p.name)
	pvc.Status.AllocatedResourceStatuses[v1.ResourceStorage] = v1.PersistentVolumeClaimNodeResizeInfeasible
	pvc.Status.Conditions = append(pvc.Status.Conditions, v1.PersistentVolumeClaimCondition{
		Type: v1.PersistentVolumeClaimNodeResizeError, Status: v1.ConditionTrue, LastTransitionTime: metav1.Now(), Message: "injected by the test",
	})
	if _, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).UpdateStatus(context.Background(), pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.WaitForCalls("a second ControllerExpandVolume", func(c []testdriver.Call) bool {
		return len(expandCalls(c)[p.volumeID]) == 2
	})
	s.WaitUntil("the resize is handed to the node again", func() bool {
		return resizeState(s.pvc(p.name)) == v1.PersistentVolumeClaimNodeResizePending
	})
	pvc = s.pvc(p.name)
	if a := pvc.Status.AllocatedResources[v1.ResourceStorage]; a.String() != "2Gi" || capacityOf(pvc) != "1Gi" {
		t.Errorf("allocated %s capacity %s, want 2Gi and 1Gi (the node's part still to do)", a.String(), capacityOf(pvc))
	}
	for _, c := range expandCalls(s.Driver.Journal())[p.volumeID] {
		if c.Code != "OK" {
			t.Errorf("ControllerExpandVolume %+v, want OK", c)
		}
	}
}

// A PVC bound to a PV the resizer's informer does not show yet is retried with backoff
// (workqueue_retries_total counts it), and expanded once the PV appears, with no resync to
// wait for (ten minutes).
func TestPVCreatedAfterItsPVCIsExpanded(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	a := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	// The PVC first, bound to a PV that does not exist yet, asking for more than it has.
	p, pv := s.createClaimFirst("claim", "")
	s.request(p.name, "2Gi")
	queue := s.Driver.DriverName() + "-pvc"
	s.WaitUntil("the PVC is retried while its PV is missing", func() bool {
		return retries(t, a, queue) > 0
	})
	if n := len(expandCalls(s.Driver.Journal())); n != 0 {
		t.Fatalf("%d volumes expanded without a PV", n)
	}

	s.createPV(pv)
	s.WaitUntil("the PVC is expanded", func() bool { return capacityOf(s.pvc(p.name)) == "2Gi" })
	if c := pvCapacity(s.pvObject(p.pv)); c != "2Gi" {
		t.Errorf("PV capacity %s, want 2Gi", c)
	}
}

// retries reads workqueue_retries_total of queue from a replica's metrics.
func retries(t *testing.T, r *e2e.Replica, queue string) float64 {
	t.Helper()
	code, body := r.Get("/metrics")
	if code != http.StatusOK {
		t.Fatalf("metrics: %d %s", code, body)
	}
	prefix := `workqueue_retries_total{name="` + queue + `"} `
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, prefix); ok {
			var n float64
			fmt.Sscan(v, &n)
			return n
		}
	}
	return 0
}
