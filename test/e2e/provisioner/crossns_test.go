package provisioner

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"
	gatewayv1beta1 "sigs.k8s.io/gateway-api/apis/v1beta1"
	gatewayclientset "sigs.k8s.io/gateway-api/pkg/client/clientset/versioned"
	"sigs.k8s.io/yaml"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

var crdsResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

const referenceGrantCRD = "referencegrants.gateway.networking.k8s.io"

// With --feature-gates=CrossNamespaceVolumeDataSource=true (which exited 2 before) the
// provisioner runs; with no ReferenceGrant CRD in the cluster it provisions plain claims
// and tells a cross-namespace claim what is missing. Once the CRD is installed, a clone of
// another namespace's claim waits for its grant with a ProvisioningFailed event, and is
// provisioned as soon as the grant is created, its source protected meanwhile, while the
// claim's own backoff (a minute here) would still be running.
func TestACrossNamespaceCloneIsProvisionedOnceAReferenceGrantAllowsIt(t *testing.T) {
	s := newScenario(t, testdriver.Config{ControllerCapabilities: withCapabilities(csi.ControllerServiceCapability_RPC_CLONE_VOLUME)})
	dyn, err := dynamic.NewForConfig(s.CP.Config())
	if err != nil {
		t.Fatal(err)
	}
	removeReferenceGrantCRD(t, s, dyn)
	t.Cleanup(func() { removeReferenceGrantCRD(t, s, dyn) })
	fast := s.createClass("fast", nil)
	gate := []string{"--feature-gates=CrossNamespaceVolumeDataSource=true", "--retry-interval-start=1m", "--retry-interval-max=1m"}

	// No CRD: plain claims are provisioned all the same.
	a := s.startReplica("replica-a", gate...)
	s.WaitForHolder(s.leaseName, "replica-a")
	srcHandle := s.provisionBoundSource("src", fast.Name)

	dst := s.Namespace + "-dst"
	if _, err := s.Client.CoreV1().Namespaces().Create(s.ctx(), &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: dst}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Client.CoreV1().Namespaces().Delete(context.Background(), dst, metav1.DeleteOptions{}) })
	clone := s.createCrossNamespaceClone(dst, "clone", fast.Name, "src")
	if ns := clone.Spec.DataSourceRef.Namespace; ns == nil || *ns != s.Namespace {
		t.Fatalf("the API server dropped dataSourceRef.namespace (%v): its CrossNamespaceVolumeDataSource gate is off", ns)
	}
	s.waitForEventIn(dst, "clone", "the CRD named as missing", "install the Gateway API's ReferenceGrant CRD")

	// The CRD installed, a replica that reads the grants: still none allows the clone.
	a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Fatalf("replica-a exited %d, want 0", code)
	}
	installReferenceGrantCRD(t, s, dyn)
	s.startReplica("replica-b", gate...)
	s.WaitForHolder(s.leaseName, "replica-b")
	s.waitForEventIn(dst, "clone", "the refusal for want of a grant", "no ReferenceGrant allows it")
	if pvs := s.pvsByClaim()[clone.UID]; len(pvs) != 0 {
		t.Fatalf("the clone was provisioned without a grant: %v", pvs[0].Name)
	}

	// The grant: the clone is made from the source in the other namespace, which carries
	// the cloning finalizer meanwhile.
	release := s.Driver.Hold(testdriver.MethodCreateVolume)
	t.Cleanup(release)
	grants, err := gatewayclientset.NewForConfig(s.CP.Config())
	if err != nil {
		t.Fatal(err)
	}
	grant := &gatewayv1beta1.ReferenceGrant{
		ObjectMeta: metav1.ObjectMeta{Name: "clones-of-src"},
		Spec: gatewayv1beta1.ReferenceGrantSpec{
			From: []gatewayv1beta1.ReferenceGrantFrom{{Group: "", Kind: "PersistentVolumeClaim", Namespace: gatewayv1.Namespace(dst)}},
			To:   []gatewayv1beta1.ReferenceGrantTo{{Group: "", Kind: "PersistentVolumeClaim", Name: ptr.To(gatewayv1.ObjectName("src"))}},
		},
	}
	granted := time.Now()
	if _, err := grants.GatewayV1beta1().ReferenceGrants(s.Namespace).Create(s.ctx(), grant, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the cloning finalizer on the source", func() bool { return slices.Contains(s.claimFinalizers("src"), cloneFinalizer) })
	release()
	// Sooner than the claim's backoff would have retried it.
	if err := wait.PollUntilContextTimeout(s.ctx(), 50*time.Millisecond, 45*time.Second, true, func(context.Context) (bool, error) {
		return len(s.pvsByClaim()[clone.UID]) == 1, nil
	}); err != nil {
		t.Fatalf("the clone's PersistentVolume did not come before the claim's one-minute backoff: %v", err)
	}
	t.Logf("FIGURE cross-namespace clone provisioned %v after its ReferenceGrant", time.Since(granted).Round(time.Millisecond))
	s.checkMadeFrom([]*v1.PersistentVolumeClaim{clone}, func(src *csi.VolumeContentSource) bool { return src.GetVolume().GetVolumeId() == srcHandle })
	// Bound once its record is closed, as kube-controller-manager would bind it: the
	// source is free again.
	s.WaitUntil("the clone's record closed", func() bool {
		list, err := s.Client.CoreV1().Events(dst).List(s.ctx(), metav1.ListOptions{FieldSelector: "involvedObject.name=clone,reason=ProvisioningSucceeded"})
		return err == nil && len(list.Items) > 0
	})
	pv := s.pvsByClaim()[clone.UID][0]
	if err := (e2e.Storage{Kube: s.Client, Namespace: dst, Driver: s.driver}).Bind(s.ctx(), pv); err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the cloning finalizer gone", func() bool { return !slices.Contains(s.claimFinalizers("src"), cloneFinalizer) })
}

// createCrossNamespaceClone creates claim namespace/name of class cloning claim source of
// the scenario's namespace.
func (s *scenario) createCrossNamespaceClone(namespace, name, class, source string) *v1.PersistentVolumeClaim {
	s.T.Helper()
	claim := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{volumehelpers.AnnStorageProvisioner: s.driver}},
		Spec: v1.PersistentVolumeClaimSpec{
			AccessModes:      []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			StorageClassName: &class,
			Resources:        v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
			DataSourceRef:    &v1.TypedObjectReference{Kind: "PersistentVolumeClaim", Name: source, Namespace: ptr.To(s.Namespace)},
		},
	}
	claim, err := s.Client.CoreV1().PersistentVolumeClaims(namespace).Create(s.ctx(), claim, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return claim
}

// waitForEventIn waits for a ProvisioningFailed event about object namespace/name whose
// message contains text.
func (s *scenario) waitForEventIn(namespace, name, what, text string) {
	s.T.Helper()
	s.WaitUntil(what, func() bool {
		list, err := s.Client.CoreV1().Events(namespace).List(s.ctx(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
		if err != nil {
			return false
		}
		return slices.ContainsFunc(list.Items, func(e v1.Event) bool {
			return e.Reason == "ProvisioningFailed" && strings.Contains(e.Message, text)
		})
	})
}

// installReferenceGrantCRD installs the ReferenceGrant CRD the gateway-api module ships
// (config/crd/standard) and waits until v1beta1 is served.
func installReferenceGrantCRD(t *testing.T, s *scenario, dyn dynamic.Interface) {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/gateway-api").Output()
	if err != nil {
		t.Fatalf("locating the gateway-api module: %v", err)
	}
	path := filepath.Join(strings.TrimSpace(string(out)), "config", "crd", "standard", "gateway.networking.k8s.io_referencegrants.yaml")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	crd := &unstructured.Unstructured{}
	if err := yaml.Unmarshal(data, &crd.Object); err != nil {
		t.Fatalf("parsing %s: %v", path, err)
	}
	if _, err := dyn.Resource(crdsResource).Create(s.ctx(), crd, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating the ReferenceGrant CRD: %v", err)
	}
	grants := dyn.Resource(schema.GroupVersionResource{Group: "gateway.networking.k8s.io", Version: "v1beta1", Resource: "referencegrants"})
	s.WaitUntil("the ReferenceGrant API served", func() bool {
		_, err := grants.Namespace(s.Namespace).List(s.ctx(), metav1.ListOptions{})
		return err == nil
	})
}

// removeReferenceGrantCRD deletes the CRD if it is there and waits until it is gone.
func removeReferenceGrantCRD(t *testing.T, s *scenario, dyn dynamic.Interface) {
	t.Helper()
	err := dyn.Resource(crdsResource).Delete(context.Background(), referenceGrantCRD, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return
	} else if err != nil {
		t.Fatal(fmt.Errorf("deleting the ReferenceGrant CRD: %w", err))
	}
	s.WaitUntil("the ReferenceGrant CRD gone", func() bool {
		_, err := dyn.Resource(crdsResource).Get(context.Background(), referenceGrantCRD, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
}
