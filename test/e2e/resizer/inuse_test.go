package resizer

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// An offline-only driver refuses to expand a volume while a Pod uses it
// (--handle-volume-inuse-error, on by default): the resizer calls the driver once, does
// not call again while the Pod exists (neither on its backoff timer nor when the user asks
// for more), and retries as soon as the Pod is deleted, which completes the expansion.
func TestInUseExpansionWaitsForThePodToGo(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	p := s.createPair("claim", "")
	// other is a PVC whose first call fails with an error that is retried on the backoff
	// timer: its retry completing shows that a retry timer as long as the in-use PVC's
	// would have been has fired (see below).
	other := s.createPair("other", "")
	// Every call for the in-use volume fails until the fault is cleared, so a retry
	// while the Pod exists would show in the journal as a second call.
	if err := s.Driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerExpandVolume, Volume: p.volumeID, Code: codes.FailedPrecondition}); err != nil {
		t.Fatal(err)
	}
	if err := s.Driver.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerExpandVolume, Volume: other.volumeID, Code: codes.Internal, Times: 1}); err != nil {
		t.Fatal(err)
	}
	s.createPodUsing("app", p.name)

	// A short first backoff step, so that a wrong retry of the in-use PVC would come soon
	// and the window below, bounded by other's retry, stays short.
	const retryStart = 100 * time.Millisecond
	a := s.startReplica("replica-a", "--retry-interval-start="+retryStart.String())
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	s.request(p.name, "2Gi")
	s.WaitForCalls("the in-use refusal", func(calls []testdriver.Call) bool {
		c := expandCalls(calls)[p.volumeID]
		return len(c) > 0 && c[0].Code == "FailedPrecondition"
	})
	// other fails after the in-use refusal, so its backoff retry comes due after the one a
	// wrong handling of the refusal would have started (both first steps are retryStart).
	s.request(other.name, "2Gi")
	s.WaitUntil(other.name+" resized on its retry", func() bool { return capacityOf(s.pvc(other.name)) == "2Gi" })
	if c := expandCalls(s.Driver.Journal())[other.volumeID]; len(c) != 2 || c[0].Code != "Internal" || c[1].Code != "OK" {
		t.Errorf("%s: calls %+v, want Internal then OK", other.name, c)
	}
	// A user asking for more while the Pod runs makes the resizer look at the PVC again; it
	// tells the user it waits for the Pod instead of calling the driver.
	before := s.inUseEvents(p.name)
	s.request(p.name, "3Gi")
	s.WaitUntil("the in-use event for the larger request (or a wrong retry)", func() bool {
		return s.inUseEvents(p.name) > before || len(expandCalls(s.Driver.Journal())[p.volumeID]) > 1
	})

	whilePod := expandCalls(s.Driver.Journal())[p.volumeID]
	if len(whilePod) != 1 || whilePod[0].Code != "FailedPrecondition" {
		t.Fatalf("calls while the Pod exists: %+v, want the first one (FailedPrecondition) only", whilePod)
	}
	window := time.Since(whilePod[0].End)
	if c := pvCapacity(s.pvObject(p.pv)); c != "1Gi" {
		t.Errorf("PV capacity %s while the Pod exists, want 1Gi", c)
	}
	if pvc := s.pvc(p.name); !hasCondition(pvc, v1.PersistentVolumeClaimControllerResizeError) {
		t.Errorf("no ControllerResizeError condition after the refusal: %+v", pvc.Status.Conditions)
	}

	// The driver would now accept (the volume is no longer in use); the Pod goes away.
	s.Driver.ClearFaults()
	deleted := time.Now()
	if err := s.Client.CoreV1().Pods(s.Namespace).Delete(context.Background(), "app", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the expansion completes after the Pod went away", func() bool {
		return capacityOf(s.pvc(p.name)) == "3Gi" && pvCapacity(s.pvObject(p.pv)) == "3Gi"
	})
	calls := expandCalls(s.Driver.Journal())[p.volumeID]
	var beforeDelete int
	for _, c := range calls {
		if c.Start.Before(deleted) {
			beforeDelete++
		}
	}
	if beforeDelete != 1 {
		t.Errorf("%d ControllerExpandVolume calls for %s started while the Pod existed, want 1", beforeDelete, p.name)
	}
	if len(calls) != 2 || calls[1].Code != "OK" {
		t.Fatalf("calls %+v, want FailedPrecondition then OK", calls)
	}
	retry := calls[1].Start.Sub(deleted)
	// Nothing else would retry before the 10m resync: the refusal left no backoff pending.
	// The bound is generous for a loaded machine; the figure is what it takes.
	if retry > 5*time.Second {
		t.Errorf("retried %v after the Pod was deleted, want at once", retry)
	}
	if v, _ := s.Driver.Volume(p.volumeID); v.CapacityBytes != 3<<30 {
		t.Errorf("backend volume %d bytes, want 3Gi", v.CapacityBytes)
	}
	t.Logf("FIGURE in-use: 1 ControllerExpandVolume call in %v while the Pod existed (retry start %v); retried %v after the Pod's deletion",
		window.Round(time.Millisecond), retryStart, retry.Round(time.Millisecond))
}

// createPodUsing creates a Pod on a node that mounts claim, as the scheduler and kubelet
// would leave it: bound to a node and Running. The namespace gets the default
// ServiceAccount first, which the ServiceAccount admission plugin looks up for every Pod.
func (s *scenario) createPodUsing(name, claim string) {
	s.T.Helper()
	ctx := context.Background()
	sa := &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}
	if _, err := s.Client.CoreV1().ServiceAccounts(s.Namespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PodSpec{
			NodeName:                     "node-a",
			AutomountServiceAccountToken: ptr.To(false),
			Containers:                   []v1.Container{{Name: "app", Image: "app", VolumeMounts: []v1.VolumeMount{{Name: "data", MountPath: "/data"}}}},
			Volumes: []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{
				PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: claim},
			}}},
		},
	}
	pod, err := s.Client.CoreV1().Pods(s.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	pod.Status.Phase = v1.PodRunning
	if _, err := s.Client.CoreV1().Pods(s.Namespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		s.T.Fatal(err)
	}
}

// inUseEvents is how many times the resizer told the user that claim waits for a Pod (the
// event recorder counts repeats of one event on one Event object).
func (s *scenario) inUseEvents(claim string) int32 {
	s.T.Helper()
	events, err := s.Client.CoreV1().Events(s.Namespace).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + claim})
	if err != nil {
		s.T.Fatal(err)
	}
	var n int32
	for _, e := range events.Items {
		if e.Reason == "VolumeResizeFailed" && strings.Contains(e.Message, "currently in-use") {
			n += max(e.Count, 1)
		}
	}
	return n
}
