package provisioner

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	volumehelpers "k8s.io/component-helpers/storage/volume"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/draintest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/record"
)

// drainingDriver stands for the core's connection to the driver while the replica drains:
// the methods it is told to refuse ("CreateVolume", "DeleteVolume") get the core's
// refusal and never reach the driver; other calls go through. It remembers how many API
// actions the clientset had seen at the first refused call, to tell the writes after it
// from those before.
type drainingDriver struct {
	csi.ControllerClient
	kube *fake.Clientset

	mu sync.Mutex
	// refused holds the refusal of each method refused now.
	refused map[string]error
	// actionsAtCall is the number of API actions before the first refused call; -1 for
	// none yet.
	actionsAtCall int
}

// newDrainingWorld is a held world (the test runs each sync itself) whose controller calls
// the driver through a drainingDriver, refusing nothing yet.
func newDrainingWorld(t *testing.T, objects ...runtime.Object) (*world, *drainingDriver) {
	t.Helper()
	d := &drainingDriver{refused: map[string]error{}, actionsAtCall: -1}
	w := newHeldWorld(t, testdriver.Config{}, func(c *config) {
		d.ControllerClient = c.csi
		c.csi = d
	}, objects...)
	d.kube = w.kube
	return w, d
}

// refuse makes the drain refuse method from now on.
func (d *drainingDriver) refuse(t *testing.T, method string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.refused[method] = draintest.RefusedByDrain(t, method)
}

// allow lets every call through again, as on the next leader.
func (d *drainingDriver) allow() {
	d.mu.Lock()
	defer d.mu.Unlock()
	clear(d.refused)
}

func (d *drainingDriver) refusal(method string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	err := d.refused[method]
	if err != nil && d.actionsAtCall < 0 {
		d.actionsAtCall = len(d.kube.Actions())
	}
	return err
}

func (d *drainingDriver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest, opts ...grpc.CallOption) (*csi.CreateVolumeResponse, error) {
	if err := d.refusal("CreateVolume"); err != nil {
		return nil, err
	}
	return d.ControllerClient.CreateVolume(ctx, req, opts...)
}

func (d *drainingDriver) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest, opts ...grpc.CallOption) (*csi.DeleteVolumeResponse, error) {
	if err := d.refusal("DeleteVolume"); err != nil {
		return nil, err
	}
	return d.ControllerClient.DeleteVolume(ctx, req, opts...)
}

// checkNothingRecorded fails the test if no call was refused, if anything was written
// after the refused call (an event written through the API included), or if the recorder
// got an event at all since events() was last called: a call the drain refused failed
// nothing, and the drain spends no write on it.
func (d *drainingDriver) checkNothingRecorded(w *world) {
	w.t.Helper()
	d.mu.Lock()
	at := d.actionsAtCall
	d.mu.Unlock()
	if at < 0 {
		w.t.Fatal("no CSI call was refused, want one")
	}
	for _, a := range w.kube.Actions()[at:] {
		if v := a.GetVerb(); v != "get" && v != "list" && v != "watch" {
			w.t.Errorf("%s %s after the refused call, want no write", v, a.GetResource().Resource)
		}
	}
	for {
		select {
		case e := <-w.recorder.Events:
			w.t.Errorf("event %q, want none", e)
		default:
			return
		}
	}
}

// A CreateVolume the drain refused records nothing: no ProvisioningFailed event, no
// PersistentVolume, no write at all after it. The record, opened before the call, stays
// open: a new leader, starting from what the API server holds, provisions the claim and
// closes it.
func TestACreateVolumeTheDrainRefusedRecordsNothing(t *testing.T) {
	w, d := newDrainingWorld(t, class("fast", nil), claimFor("data", "uid-1", "fast"))
	d.refuse(t, "CreateVolume")

	if err := w.ctrl.syncClaim("uid-1"); !lifecycle.NotStarted(err) {
		t.Fatalf("syncClaim: %v, want the refusal", err)
	}
	d.checkNothingRecorded(w)
	if events := w.events(); len(events) != 1 || !strings.Contains(events[0], record.ReasonProvisioning) {
		t.Errorf("events %q, want only the record's %s, written before the call", events, record.ReasonProvisioning)
	}
	if w.pv("pvc-uid-1") != nil {
		t.Error("a PersistentVolume was saved for a volume never made")
	}
	if r := w.record("uid-1"); r == nil || r.Record.Volume != "pvc-uid-1" {
		t.Fatalf("record %+v, want it open for volume pvc-uid-1: the next leader must find it", r)
	}
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 0 {
		t.Errorf("%d CreateVolume calls reached the driver, want none", n)
	}

	// The next leader finds the claim and its open record, and finishes.
	next := newWorld(t, testdriver.Config{}, nil, leftBehind(t, w)...)
	next.waitFor("the PersistentVolume, and the record closed", func() bool { return next.pv("pvc-uid-1") != nil && next.record("uid-1") == nil })
}

// leftBehind is what a world's API server holds that the next leader starts from: the
// StorageClasses, claims, PersistentVolumes and events.
func leftBehind(t *testing.T, w *world) []runtime.Object {
	t.Helper()
	ctx, all := context.Background(), metav1.ListOptions{}
	var out []runtime.Object
	add := func(list runtime.Object, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		items, err := meta.ExtractList(list)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, items...)
	}
	add(w.kube.StorageV1().StorageClasses().List(ctx, all))
	add(w.kube.CoreV1().PersistentVolumeClaims("").List(ctx, all))
	add(w.kube.CoreV1().PersistentVolumes().List(ctx, all))
	add(w.kube.CoreV1().Events("").List(ctx, all))
	return out
}

// A DeleteVolume of a released PersistentVolume the drain refused records nothing: no
// VolumeFailedDelete event, no write after it; the PersistentVolume and the provisioner's
// finalizer on it stay, and the volume is deleted on the next sync.
func TestADeleteVolumeOfAReleasedVolumeTheDrainRefusedRecordsNothing(t *testing.T) {
	fin := volumehelpers.PVDeletionProtectionFinalizer
	w, d := newDrainingWorld(t, class("fast", nil), &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "del-creds", Namespace: "ns"}})
	id := w.createVolume("pvc-del")
	w.create(releasedPV("pvc-del", id, v1.PersistentVolumeReclaimDelete, fin))
	w.waitFor("the PersistentVolume in the cache", func() bool { _, err := w.ctrl.volumes.Get("pvc-del"); return err == nil })
	d.refuse(t, "DeleteVolume")

	if err := w.ctrl.deleter.Sync("pvc-del"); !lifecycle.NotStarted(err) {
		t.Fatalf("syncVolume: %v, want the refusal", err)
	}
	d.checkNothingRecorded(w)
	if pv := w.pv("pvc-del"); pv == nil || pv.DeletionTimestamp != nil || !slices.Contains(pv.Finalizers, fin) {
		t.Errorf("PersistentVolume %+v, want it kept, not being deleted, with %s", pv, fin)
	}
	if _, ok := w.driver.Volume(id); !ok {
		t.Error("the volume is gone from the driver though DeleteVolume was refused")
	}

	// The next sync (here, or the next leader's) deletes it.
	d.allow()
	if err := w.ctrl.deleter.Sync("pvc-del"); err != nil {
		t.Fatal(err)
	}
	if _, ok := w.driver.Volume(id); ok || w.pv("pvc-del") != nil {
		t.Errorf("volume in the driver: %v, PersistentVolume %v: want both gone", ok, w.pv("pvc-del"))
	}
}

// The undo of a record whose claim is gone records nothing when the drain refuses its
// CreateVolume (sent again to learn the volume's ID) or its DeleteVolume: no
// ProvisioningUndoFailed event, no ProvisioningUndone, no write after the call. The
// record stays open and the volume in the driver: the next sync undoes it.
func TestAnUndoTheDrainRefusedRecordsNothing(t *testing.T) {
	for _, method := range []string{"CreateVolume", "DeleteVolume"} {
		t.Run(method, func(t *testing.T) {
			w, d := newDrainingWorld(t, class("fast", nil))
			rec, err := record.New(drv, "", nil, objects.CreateVolumeRequest("pvc-uid-1"))
			if err != nil {
				t.Fatal(err)
			}
			// A dead leader recorded the volume and made it; the claim is gone since.
			resp, err := d.ControllerClient.CreateVolume(context.Background(), objects.CreateVolumeRequest("pvc-uid-1"))
			if err != nil {
				t.Fatal(err)
			}
			id := resp.GetVolume().GetVolumeId()
			w.create(deadLeaderRecord(t, claimFor("data", "uid-1", "fast"), rec))
			w.waitFor("the record in the cache", func() bool { return w.ctrl.records.IsOpen("uid-1") })
			w.events()
			d.refuse(t, method)

			if err := w.ctrl.syncClaim("uid-1"); !lifecycle.NotStarted(err) {
				t.Fatalf("syncClaim: %v, want the refusal", err)
			}
			d.checkNothingRecorded(w)
			if events := w.events(); len(events) != 0 {
				t.Errorf("events %q, want none", events)
			}
			if w.record("uid-1") == nil {
				t.Error("the record was closed though the volume may exist")
			}
			if _, ok := w.driver.Volume(id); !ok {
				t.Error("the volume is gone from the driver though the undo was refused")
			}

			// The next sync undoes it.
			d.allow()
			if err := w.ctrl.syncClaim("uid-1"); err != nil {
				t.Fatal(err)
			}
			if _, ok := w.driver.Volume(id); ok || w.record("uid-1") != nil {
				t.Errorf("volume in the driver: %v, record %+v: want the volume deleted and the record closed", ok, w.record("uid-1"))
			}
		})
	}
}
