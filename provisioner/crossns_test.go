package provisioner

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"
	gatewayv1beta1 "sigs.k8s.io/gateway-api/apis/v1beta1"
	gatewayfake "sigs.k8s.io/gateway-api/pkg/client/clientset/versioned/fake"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// crossNamespaceClone is claim dst/dst cloning src/src, bound to a volume of the driver,
// as the API server keeps it with its CrossNamespaceVolumeDataSource gate on: dataSourceRef
// only.
func crossNamespaceClone() (src *v1.PersistentVolumeClaim, srcPV *v1.PersistentVolume, dst *v1.PersistentVolumeClaim) {
	src, srcPV = boundSource()
	src.Namespace = "src"
	srcPV.Spec.ClaimRef.Namespace = "src"
	dst = claimFor("dst", "uid-dst", "fast")
	dst.Namespace = "dst"
	dst.Spec.DataSourceRef = &v1.TypedObjectReference{Kind: request.PVCKind, Name: "src", Namespace: ptr.To("src")}
	return src, srcPV, dst
}

func claimGrant(to string) *gatewayv1beta1.ReferenceGrant {
	return &gatewayv1beta1.ReferenceGrant{
		ObjectMeta: metav1.ObjectMeta{Namespace: "src", Name: "clones"},
		Spec: gatewayv1beta1.ReferenceGrantSpec{
			From: []gatewayv1beta1.ReferenceGrantFrom{{Kind: "PersistentVolumeClaim", Namespace: "dst"}},
			To:   []gatewayv1beta1.ReferenceGrantTo{{Kind: "PersistentVolumeClaim", Name: ptr.To(gatewayv1.ObjectName(to))}},
		},
	}
}

func cloneCaps() []csi.ControllerServiceCapability_RPC_Type {
	return append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CLONE_VOLUME)
}

func (w *world) waitForEvent(what, text string) {
	w.t.Helper()
	var seen []string
	w.waitFor(what, func() bool {
		seen = append(seen, w.events()...)
		return slices.ContainsFunc(seen, func(e string) bool { return strings.Contains(e, text) })
	})
}

// A claim whose source is in another namespace waits, with an event saying why, until a
// ReferenceGrant allows it; the grant's arrival provisions it at once, not after the
// claim's backoff (a minute here), and the source in the other namespace is protected
// by the cloning finalizer while its volume is made.
func TestACrossNamespaceCloneWaitsForItsGrantAndIsMadeAsSoonAsItComes(t *testing.T) {
	grantClient := gatewayfake.NewClientset()
	src, srcPV, dst := crossNamespaceClone()
	w := newWorld(t, testdriver.Config{ControllerCapabilities: cloneCaps()}, func(c *config) {
		c.grantClient = grantClient
		c.opts.retryIntervalStart, c.opts.retryIntervalMax = time.Minute, time.Minute
	}, class("fast", nil), src)
	srcPV.Spec.CSI.VolumeHandle = w.sourceVolume()
	w.create(srcPV, dst)

	w.waitForEvent("a ProvisioningFailed event saying no grant allows it", "no ReferenceGrant allows it")
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 1 { // the source's
		t.Fatalf("%d CreateVolume calls, want only the source's", n)
	}

	// A grant for another claim of the namespace allows nothing.
	if _, err := grantClient.GatewayV1beta1().ReferenceGrants("src").Create(context.Background(), claimGrant("other"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitForEvent("the claim refused again at once", "no ReferenceGrant allows it")
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 1 {
		t.Fatalf("%d CreateVolume calls after a grant of another claim, want only the source's", n)
	}

	g := claimGrant("src")
	g.Name = "clone-src"
	if _, err := grantClient.GatewayV1beta1().ReferenceGrants("src").Create(context.Background(), g, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the clone's PersistentVolume", func() bool { return w.pv("pvc-uid-dst") != nil })
	calls := w.calls(testdriver.MethodCreateVolume)
	vol, _ := w.driver.Volume(calls[len(calls)-1].VolumeID)
	if got := vol.ContentSource.GetVolume().GetVolumeId(); got != srcPV.Spec.CSI.VolumeHandle {
		t.Errorf("volume made from %q, want a clone of %q", got, srcPV.Spec.CSI.VolumeHandle)
	}
	// Bound, as kube-controller-manager binds it, once its record is closed: the source
	// is free again.
	w.waitFor("the clone's record closed", func() bool { return w.record("uid-dst") == nil })
	bound, err := w.kube.CoreV1().PersistentVolumeClaims("dst").Get(context.Background(), "dst", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	bound.Spec.VolumeName, bound.Status.Phase = "pvc-uid-dst", v1.ClaimBound
	if _, err := w.kube.CoreV1().PersistentVolumeClaims("dst").Update(context.Background(), bound, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	w.waitFor("the cloning finalizer gone from src/src", func() bool {
		c, err := w.kube.CoreV1().PersistentVolumeClaims("src").Get(context.Background(), "src", metav1.GetOptions{})
		return err == nil && !slices.Contains(c.Finalizers, request.CloneProtectionFinalizer)
	})
	if !finalizerWasAdded(w.kube.Actions(), "src", "src") {
		t.Errorf("the source in the other namespace never carried %s while its clone was made", request.CloneProtectionFinalizer)
	}
}

// finalizerWasAdded tells whether an update of claim namespace/name carried the cloning
// finalizer.
func finalizerWasAdded(actions []k8stesting.Action, namespace, name string) bool {
	for _, a := range actions {
		u, ok := a.(k8stesting.UpdateAction)
		if !ok || a.GetResource().Resource != "persistentvolumeclaims" || a.GetNamespace() != namespace {
			continue
		}
		if c := u.GetObject().(*v1.PersistentVolumeClaim); c.Name == name && slices.Contains(c.Finalizers, request.CloneProtectionFinalizer) {
			return true
		}
	}
	return false
}

// Without the gate, a claim whose dataSourceRef names another namespace (an API server
// with its gate on keeps it) is refused in upstream's words.
func TestWithoutTheGateACrossNamespaceSourceIsRefused(t *testing.T) {
	src, srcPV, dst := crossNamespaceClone()
	w := newWorld(t, testdriver.Config{ControllerCapabilities: cloneCaps()}, nil, class("fast", nil), src, srcPV, dst)
	w.waitForEvent("a ProvisioningFailed event naming the gate", "CrossNamespaceVolumeDataSource feature is disabled")
	if n := len(w.calls(testdriver.MethodCreateVolume)); n != 0 {
		t.Errorf("%d CreateVolume calls, want none", n)
	}
}

// A cluster without the ReferenceGrant CRD, or an RBAC without list and watch on the
// grants, still provisions every other claim; a cross-namespace claim is told what is
// missing.
func TestMissingGrantsHoldBackOnlyCrossNamespaceClaims(t *testing.T) {
	gr := schema.GroupResource{Group: "gateway.networking.k8s.io", Resource: "referencegrants"}
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{name: "no CRD", err: apierrors.NewNotFound(gr, ""), want: "install the Gateway API's ReferenceGrant CRD"},
		{name: "no permission", err: apierrors.NewForbidden(gr, "", errors.New("RBAC")), want: "grant get, list and watch"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			grantClient := gatewayfake.NewClientset()
			grantClient.PrependReactor("list", "referencegrants", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, tc.err })
			grantClient.PrependWatchReactor("referencegrants", func(k8stesting.Action) (bool, watch.Interface, error) { return true, nil, tc.err })
			src, srcPV, dst := crossNamespaceClone()
			plain := claimFor("plain", "uid-plain", "fast")
			w := newWorld(t, testdriver.Config{ControllerCapabilities: cloneCaps()}, func(c *config) { c.grantClient = grantClient },
				class("fast", nil), src, srcPV, dst, plain)
			w.waitFor("the plain claim's PersistentVolume", func() bool { return w.pv("pvc-uid-plain") != nil })
			w.waitForEvent("a ProvisioningFailed event saying what is missing", tc.want)
			if w.pv("pvc-uid-dst") != nil {
				t.Errorf("the cross-namespace claim was provisioned without a readable grant")
			}
		})
	}
}

// A claim of another namespace that names a source without a grant does not keep the
// source's protection: it could otherwise keep any namespace's claims from being deleted.
func TestAnUngrantedClaimOfAnotherNamespaceDoesNotKeepTheSourcesFinalizer(t *testing.T) {
	src, srcPV, dst := crossNamespaceClone()
	src.Finalizers = []string{request.CloneProtectionFinalizer}
	w := newWorld(t, testdriver.Config{ControllerCapabilities: cloneCaps()}, func(c *config) { c.grantClient = gatewayfake.NewClientset() },
		class("fast", nil), src, srcPV, dst)
	w.waitFor("the cloning finalizer gone from src/src", func() bool {
		c, err := w.kube.CoreV1().PersistentVolumeClaims("src").Get(context.Background(), "src", metav1.GetOptions{})
		return err == nil && !slices.Contains(c.Finalizers, request.CloneProtectionFinalizer)
	})
}

// A restore from a VolumeSnapshot of another namespace that a grant allows: the volume is
// made from the snapshot, which carries the source-protection finalizer meanwhile.
func TestARestoreFromAGrantedSnapshotOfAnotherNamespaceProtectsIt(t *testing.T) {
	caps := append(testdriver.DefaultControllerCapabilities(), csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)
	snaps := snapfake.NewSimpleClientset()
	grant := &gatewayv1beta1.ReferenceGrant{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "restores"},
		Spec: gatewayv1beta1.ReferenceGrantSpec{
			From: []gatewayv1beta1.ReferenceGrantFrom{{Kind: "PersistentVolumeClaim", Namespace: "dst"}},
			To:   []gatewayv1beta1.ReferenceGrantTo{{Group: request.SnapshotAPIGroup, Kind: request.SnapshotKind}},
		},
	}
	w := newWorld(t, testdriver.Config{ControllerCapabilities: caps}, func(c *config) {
		c.snapshotClient = noWatchList{snaps}
		c.grantClient = gatewayfake.NewClientset(grant)
	}, class("fast", nil))
	snap, content := w.readySnapshot("snap") // in namespace ns
	for _, o := range []runtime.Object{snap, content} {
		if err := snaps.Tracker().Add(o); err != nil {
			t.Fatal(err)
		}
	}
	dst := claimFor("dst", "uid-dst", "fast")
	dst.Namespace = "dst"
	dst.Spec.DataSourceRef = &v1.TypedObjectReference{APIGroup: ptr.To(request.SnapshotAPIGroup), Kind: request.SnapshotKind, Name: "snap", Namespace: ptr.To("ns")}
	w.create(dst)

	w.waitFor("the restored PersistentVolume", func() bool { return w.pv("pvc-uid-dst") != nil })
	vol, _ := w.driver.Volume(w.pv("pvc-uid-dst").Spec.CSI.VolumeHandle)
	if got := vol.ContentSource.GetSnapshot().GetSnapshotId(); got != *content.Status.SnapshotHandle {
		t.Errorf("volume made from %v, want snapshot %s", vol.ContentSource, *content.Status.SnapshotHandle)
	}
	added := false
	for _, a := range snaps.Actions() {
		if u, ok := a.(k8stesting.UpdateAction); ok && a.GetNamespace() == "ns" {
			if s, ok := u.GetObject().(*snapshotv1.VolumeSnapshot); ok && s.Name == "snap" && slices.Contains(s.Finalizers, request.SnapshotProtectionFinalizer) {
				added = true
			}
		}
	}
	if !added {
		t.Errorf("the snapshot in the other namespace never carried %s while the volume was restored", request.SnapshotProtectionFinalizer)
	}
}
