package provisioner

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func TestAProvisionedButUnboundClaimIsNotPlannedAgain(t *testing.T) {
	// The claim's PersistentVolume exists (the PV controller has not bound it yet), and
	// its VolumeAttributesClass is gone: planning again would read the API and report a
	// false failure.
	claim := claimFor("data", "uid-1", "fast")
	claim.Spec.VolumeAttributesClassName = ptr.To("gone")
	pv := &v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pvc-uid-1"}, Spec: v1.PersistentVolumeSpec{
		PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: "h"}},
		ClaimRef:               &v1.ObjectReference{Namespace: "ns", Name: "data", UID: "uid-1"},
	}}
	w := newWorld(t, testdriver.Config{}, nil, class("fast", nil), pv, claim)
	if err := w.ctrl.syncClaim("uid-1"); err != nil {
		t.Errorf("syncClaim: %v, want nil: the volume exists", err)
	}
	if events := w.events(); slices.ContainsFunc(events, func(e string) bool { return strings.Contains(e, "ProvisioningFailed") }) {
		t.Errorf("events %v, want no ProvisioningFailed", events)
	}
	for _, a := range w.kube.Actions() {
		if a.GetVerb() == "get" && a.GetResource().Resource == "volumeattributesclasses" {
			t.Errorf("the VolumeAttributesClass was read: %v", a)
		}
	}
}

func TestSavingAPersistentVolumeReportsTheNameTakenNotAnEarlierTransientError(t *testing.T) {
	theirs := &v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pvc-uid-1"}, Spec: v1.PersistentVolumeSpec{
		ClaimRef: &v1.ObjectReference{Namespace: "ns", Name: "other", UID: "uid-other"}}}
	kube := fake.NewClientset()
	creates := 0
	kube.PrependReactor("create", "persistentvolumes", func(k8stesting.Action) (bool, runtime.Object, error) {
		creates++
		if creates == 1 {
			return true, nil, apierrors.NewServerTimeout(schema.GroupResource{Resource: "persistentvolumes"}, "create", 1)
		}
		return true, nil, apierrors.NewAlreadyExists(schema.GroupResource{Resource: "persistentvolumes"}, "pvc-uid-1")
	})
	kube.PrependReactor("get", "persistentvolumes", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, theirs, nil
	})
	c := &claimController{config: config{kube: kube}}
	mine := theirs.DeepCopy()
	mine.Spec.ClaimRef = &v1.ObjectReference{Namespace: "ns", Name: "data", UID: "uid-1"}
	err := c.savePV(context.Background(), mine)
	if err == nil || !strings.Contains(err.Error(), "exists for another claim") {
		t.Errorf("savePV: %v, want the name taken by another claim", err)
	}
}

// shrinkingDriver reports every created volume smaller than asked: it does not fit the
// claim and is deleted again.
type shrinkingDriver struct{ csi.ControllerClient }

func (d shrinkingDriver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest, opts ...grpc.CallOption) (*csi.CreateVolumeResponse, error) {
	rsp, err := d.ControllerClient.CreateVolume(ctx, req, opts...)
	if err == nil {
		rsp.Volume.CapacityBytes = 1
	}
	return rsp, err
}

func TestAVolumeThatDoesNotFitIsCleanedUpAndNotRetriedOnceTheClaimIsGone(t *testing.T) {
	w := newWorld(t, testdriver.Config{}, func(c *config) { c.csi = shrinkingDriver{c.csi} }, class("fast", nil), claimFor("data", "uid-1", "fast"))
	w.waitFor("a volume cleaned up", func() bool { return len(w.calls(testdriver.MethodDeleteVolume)) > 0 })
	if err := w.kube.CoreV1().PersistentVolumeClaims("ns").Delete(context.Background(), "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// With the claim gone nothing plans again; a plan kept after the cleanup would create
	// and delete the volume forever.
	w.waitFor("no pending plan and no volume once the claim is gone", func() bool {
		return w.ctrl.claimByUID("uid-1") == nil && w.ctrl.inFlight.get("uid-1") == nil && len(w.driver.Volumes()) == 0
	})
	if w.pv("pvc-uid-1") != nil {
		t.Error("a PersistentVolume was saved for a volume that does not fit")
	}
}

// A sync of the claim (an update by someone else, a resync) may come before the
// PersistentVolume just saved reaches the cache: the claim is not planned, recorded and
// created again meanwhile. Here the PersistentVolume never reaches the cache.
func TestASavedPersistentVolumeCountsBeforeTheCacheShowsIt(t *testing.T) {
	w := newWorld(t, testdriver.Config{}, func(c *config) {
		// Hide every PersistentVolume from the cache: its list and watch show none.
		kube := c.kube.(*fake.Clientset)
		kube.PrependReactor("list", "persistentvolumes", func(k8stesting.Action) (bool, runtime.Object, error) {
			return true, &v1.PersistentVolumeList{}, nil
		})
		kube.PrependWatchReactor("persistentvolumes", func(k8stesting.Action) (bool, watch.Interface, error) {
			return true, watch.NewFake(), nil
		})
	}, class("fast", nil))
	if _, err := w.kube.CoreV1().PersistentVolumeClaims("ns").Create(context.Background(), claimFor("data", "uid-1", "fast"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the PersistentVolume, and the record closed", func() bool { return w.pv("pvc-uid-1") != nil && w.record("uid-1") == nil })
	// The claim comes back; it must find the volume noted.
	if err := w.ctrl.syncClaim("uid-1"); err != nil {
		t.Fatal(err)
	}
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 1 {
		t.Errorf("%d CreateVolume calls, want 1", n)
	}
}
