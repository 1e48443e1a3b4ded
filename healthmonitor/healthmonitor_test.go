package healthmonitor

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	"github.com/spf13/pflag"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cachetest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

const testDriver = "unit.csi.test"

// fixture is the monitor over a fake API server and the test driver, in a synctest bubble.
type fixture struct {
	t        *testing.T
	kube     *fake.Clientset
	driver   *testdriver.Backend
	s        *Sidecar
	recorder *record.FakeRecorder
	volumes  []string // backend volume ids, claim i is "claim-i"
}

func newFixture(t *testing.T, caps []csi.ControllerServiceCapability_RPC_Type, n int, args ...string) *fixture {
	t.Helper()
	d, err := testdriver.New(testdriver.Config{DriverName: testDriver, HealthPageSize: 2,
		ControllerCapabilities: append(testdriver.DefaultControllerCapabilities(), caps...)})
	if err != nil {
		t.Fatal(err)
	}
	conn := testdriver.DialInMemory(t, d)
	client := csi.NewControllerClient(conn)
	f := &fixture{t: t, driver: d, recorder: record.NewFakeRecorder(100)}
	var objs []runtime.Object
	for i := range n {
		rsp, err := client.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: fmt.Sprint("vol-", i),
			VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}})
		if err != nil {
			t.Fatal(err)
		}
		id := rsp.GetVolume().GetVolumeId()
		f.volumes = append(f.volumes, id)
		claim, pv := fmt.Sprint("claim-", i), fmt.Sprint("pv-", i)
		objs = append(objs,
			&v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: pv},
				Spec: v1.PersistentVolumeSpec{
					PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: testDriver, VolumeHandle: id}},
					ClaimRef:               &v1.ObjectReference{Namespace: "default", Name: claim, UID: types.UID("uid-" + claim)}},
				Status: v1.PersistentVolumeStatus{Phase: v1.VolumeBound}},
			&v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: claim, UID: types.UID("uid-" + claim)},
				Spec: v1.PersistentVolumeClaimSpec{VolumeName: pv}, Status: v1.PersistentVolumeClaimStatus{Phase: v1.ClaimBound}})
	}
	f.kube = fake.NewClientset(objs...)
	capSet := rpc.ControllerCapabilitySet{}
	for _, c := range caps {
		capSet[c] = true
	}
	factory := informers.NewSharedInformerFactoryWithOptions(f.kube, 0, informers.WithTransform(cachetest.Transform()))
	events := record.NewBroadcaster()
	t.Cleanup(events.Shutdown)
	env := lifecycle.Env{Kube: f.kube, Informers: factory, Events: events, CSI: conn, DriverName: testDriver,
		PluginCapabilities:     rpc.PluginCapabilitySet{csi.PluginCapability_Service_CONTROLLER_SERVICE: true},
		ControllerCapabilities: capSet,
	}.WithOps(context.Background())
	f.s = New()
	fs := pflag.NewFlagSet(Name, pflag.ContinueOnError)
	f.s.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	if err := f.s.Setup(env); err != nil {
		t.Fatal(err)
	}
	f.s.reporter.recorder = f.recorder
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	factory.Start(stop)
	factory.WaitForCacheSync(stop)
	return f
}

// run starts Run and returns the function that ends intake and waits for Run.
func (f *fixture) run() (stop func()) {
	intake, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- f.s.Run(intake, nil) }()
	return func() {
		cancel()
		if err := <-done; err != nil {
			f.t.Errorf("Run: %v", err)
		}
	}
}

// statusWrites counts the writes of claims' status.
func (f *fixture) statusWrites() int {
	n := 0
	for _, a := range f.kube.Actions() {
		if a.GetResource().Resource == "persistentvolumeclaims" && a.GetSubresource() == "status" && a.GetVerb() != "get" {
			n++
		}
	}
	return n
}

func (f *fixture) health(i int) *v1.VolumeHealthStatus {
	f.t.Helper()
	c, err := f.kube.CoreV1().PersistentVolumeClaims("default").Get(context.Background(), fmt.Sprint("claim-", i), metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return c.Status.HealthStatus
}

func (f *fixture) setHealth(i int, conds ...testdriver.HealthCondition) {
	f.t.Helper()
	if err := f.driver.SetVolumeHealth(f.volumes[i], conds...); err != nil {
		f.t.Fatal(err)
	}
}

// events drains the recorded events.
func (f *fixture) events() []string {
	var out []string
	for {
		select {
		case e := <-f.recorder.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

var (
	listCaps = []csi.ControllerServiceCapability_RPC_Type{csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH}
	getCaps  = []csi.ControllerServiceCapability_RPC_Type{csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH}
	degraded = testdriver.HealthCondition{Status: csi.VolumeHealthErrorType_DEGRADED, Reason: "ReplicaLost", Message: "one replica of three lost"}
	lost     = testdriver.HealthCondition{Status: csi.VolumeHealthErrorType_DATA_LOSS, Reason: "Corrupt"}
)

// A list pass per --list-volumes-interval, over pages: an abnormal volume's claim gets its
// conditions once, the status stays unwritten while nothing changes, and is cleared when the
// volume is healthy again. Healthy volumes cost no write.
func TestListModeWritesOnlyChanges(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, listCaps, 6)
		f.setHealth(1, degraded)
		f.setHealth(3, lost)
		f.setHealth(4, degraded, lost)
		f.setHealth(5, degraded)
		stop := f.run()
		synctest.Wait()
		if got := f.health(4); got == nil || len(got.HealthConditions) != 2 || got.HealthConditions[0].Status != v1.VolumeHealthDataLoss ||
			got.HealthConditions[1].Status != v1.VolumeHealthDegraded || got.HealthConditions[1].Message != degraded.Message || got.LastTransitionTime.IsZero() {
			t.Errorf("claim-4 health %+v", got)
		}
		for _, i := range []int{0, 2} {
			if got := f.health(i); got != nil {
				t.Errorf("healthy claim-%d has health %+v", i, got)
			}
		}
		if n := f.statusWrites(); n != 4 {
			t.Errorf("%d status writes after the first pass, want 4", n)
		}
		if n := len(f.driver.Calls(testdriver.MethodControllerListVolumeHealth)); n != 2 {
			t.Errorf("%d list calls for four abnormal volumes in pages of two, want 2", n)
		}
		since := f.health(4).LastTransitionTime

		time.Sleep(5 * time.Minute)
		synctest.Wait()
		if n := f.statusWrites(); n != 4 {
			t.Errorf("%d status writes after an unchanged pass, want 4", n)
		}
		f.setHealth(1)
		f.setHealth(4, degraded) // a condition less: a new set
		time.Sleep(5 * time.Minute)
		synctest.Wait()
		if got := f.health(1); got != nil {
			t.Errorf("claim-1 healthy again still has %+v", got)
		}
		if got := f.health(4); got == nil || len(got.HealthConditions) != 1 || !got.LastTransitionTime.After(since.Time) {
			t.Errorf("claim-4 after losing a condition: %+v", got)
		}
		if n := f.statusWrites(); n != 6 {
			t.Errorf("%d status writes, want 6", n)
		}
		if n := len(f.driver.Calls(testdriver.MethodControllerListVolumeHealth)); n != 6 {
			t.Errorf("%d list calls after three passes, want 6", n)
		}
		stop()
		if e := f.events(); len(e) != 0 {
			t.Errorf("events where the status is kept: %q", e)
		}
	})
}

// Without LIST_VOLUME_HEALTH each bound volume gets a ControllerGetVolumeHealth per
// --monitor-interval.
func TestGetModeChecksEachVolumePerInterval(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, getCaps, 3, "--worker-threads=2")
		f.setHealth(2, lost)
		stop := f.run()
		synctest.Wait()
		if got := f.health(2); got == nil || len(got.HealthConditions) != 1 || got.HealthConditions[0].Reason != "Corrupt" {
			t.Errorf("claim-2 health %+v", got)
		}
		time.Sleep(time.Minute)
		synctest.Wait()
		if n := len(f.driver.Calls(testdriver.MethodControllerGetVolumeHealth)); n != 6 {
			t.Errorf("%d ControllerGetVolumeHealth calls in two intervals over three volumes, want 6", n)
		}
		if n := f.statusWrites(); n != 1 {
			t.Errorf("%d status writes, want 1", n)
		}
		stop()
	})
}

// Where the API server drops status.healthStatus (CSIVolumeHealth off), upstream's events
// are written, once per change.
func TestEventsWhereTheFieldIsDropped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, listCaps, 2)
		// A server that drops the field: the patch changes nothing.
		f.kube.PrependReactor("patch", "persistentvolumeclaims", func(a k8stesting.Action) (bool, runtime.Object, error) {
			p := a.(k8stesting.PatchAction)
			obj, err := f.kube.Tracker().Get(p.GetResource(), p.GetNamespace(), p.GetName())
			return true, obj, err
		})
		f.setHealth(0, degraded)
		stop := f.run()
		synctest.Wait()
		time.Sleep(5 * time.Minute)
		synctest.Wait()
		e := f.events()
		if len(e) != 1 || !strings.HasPrefix(e[0], "Warning VolumeConditionAbnormal Degraded (ReplicaLost): one replica of three lost") {
			t.Errorf("events after two passes over an abnormal volume: %q", e)
		}
		f.setHealth(0)
		time.Sleep(5 * time.Minute)
		synctest.Wait()
		time.Sleep(5 * time.Minute)
		synctest.Wait()
		if e := f.events(); len(e) != 1 || e[0] != "Normal VolumeConditionNormal The Volume returns to the healthy state" {
			t.Errorf("events after the volume recovered: %q", e)
		}
		// One patch learnt that the field is dropped; none after.
		if n := f.statusWrites(); n != 1 {
			t.Errorf("%d status writes, want 1", n)
		}
		stop()
	})
}

// A driver with neither health capability ends the process with exit code 1, as upstream.
func TestDriverWithoutHealthIsRefused(t *testing.T) {
	env := lifecycle.Env{DriverName: testDriver,
		PluginCapabilities:     rpc.PluginCapabilitySet{csi.PluginCapability_Service_CONTROLLER_SERVICE: true},
		ControllerCapabilities: rpc.ControllerCapabilitySet{csi.ControllerServiceCapability_RPC_LIST_VOLUMES: true},
	}.WithOps(context.Background())
	err := New().Setup(env)
	if err == nil || lifecycle.IsUsageError(err) || !strings.Contains(err.Error(), "LIST_VOLUME_HEALTH") {
		t.Errorf("Setup with a driver without health: %v, want a plain error naming the capabilities", err)
	}
}
