// Package deploy tests the manifests in deploy/ against a real API server: they apply with
// server-side apply, each sidecar does its job with nothing but its own ServiceAccount's
// rights, and those rights exclude what a sidecar must never do.
package deploy

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/restmapper"

	"github.com/csi-sidecars/csi-sidecars/internal/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testdriver"
)

const namespace = "csi-sidecars" // the bases' namespace

var (
	kube   controlplane.Shared
	binDir string
)

func TestMain(m *testing.M) { os.Exit(e2e.Main(m, "../../..", &kube, &binDir)) }

// build renders deploy/<dir> with the cached kustomize.
func build(t *testing.T, dir string) []*unstructured.Unstructured {
	t.Helper()
	assets, err := controlplane.Assets()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(filepath.Join(assets, "kustomize"), "build", filepath.Join("../../../deploy", dir)).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("kustomize build deploy/%s: %v\n%s", dir, err, ee.Stderr)
		}
		t.Fatalf("kustomize build deploy/%s: %v (run `make testenv`)", dir, err)
	}
	var objs []*unstructured.Unstructured
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
	for {
		obj := &unstructured.Unstructured{}
		if err := dec.Decode(&obj.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return objs
			}
			t.Fatalf("decoding deploy/%s: %v", dir, err)
		}
		if len(obj.Object) > 0 {
			objs = append(objs, obj)
		}
	}
}

// apply applies objs with server-side apply, as `kubectl apply --server-side` would.
func apply(t *testing.T, cp *controlplane.ControlPlane, objs []*unstructured.Unstructured) {
	t.Helper()
	client := kubernetes.NewForConfigOrDie(cp.Config())
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(client.Discovery()))
	dyn := dynamic.NewForConfigOrDie(cp.Config())
	for _, obj := range objs {
		gvk := obj.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			t.Fatalf("%s %s: %v", gvk.Kind, obj.GetName(), err)
		}
		var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if ns := obj.GetNamespace(); ns != "" {
			ri = dyn.Resource(m.Resource).Namespace(ns)
		}
		if _, err := ri.Apply(context.Background(), obj.GetName(), obj, metav1.ApplyOptions{FieldManager: "csi-sidecars-deploy-test", Force: true}); err != nil {
			t.Errorf("server-side apply of %s %s/%s: %v", gvk.Kind, obj.GetNamespace(), obj.GetName(), err)
		}
	}
}

func TestEveryManifestAppliesServerSide(t *testing.T) {
	cp := kube.Get(t)
	// The example holds the namespace and the three bases; applying each base again must be
	// a no-op, and so must a second apply of everything.
	for range 2 {
		for _, dir := range []string{"example", "attacher", "resizer", "provisioner"} {
			apply(t, cp, build(t, dir))
		}
	}
	client := kubernetes.NewForConfigOrDie(cp.Config())
	containers := func(want int) {
		t.Helper()
		d, err := client.AppsV1().Deployments(namespace).Get(context.Background(), "csi-controller", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if n := len(d.Spec.Template.Spec.Containers); n != want || *d.Spec.Replicas != 2 {
			t.Errorf("Deployment: %d containers, %d replicas; want %d and 2", n, *d.Spec.Replicas, want)
		}
	}
	containers(4)
	// deploy/combined keeps the Deployment's name, so applying it over the example switches
	// the cluster to combined mode in place (the three sidecar containers go, one comes),
	// and applying the example again switches back: the same field manager owns both.
	for range 2 {
		apply(t, cp, build(t, "combined"))
	}
	containers(2)
	apply(t, cp, build(t, "example"))
	containers(4)
}

// token returns a kubeconfig with a TokenRequest token of csi-<sidecar>.
func token(t *testing.T, cp *controlplane.ControlPlane, client kubernetes.Interface, sidecar string) string {
	t.Helper()
	tr, err := client.CoreV1().ServiceAccounts(namespace).CreateToken(context.Background(), "csi-"+sidecar,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptrTo(int64(3600))}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("TokenRequest for csi-%s: %v", sidecar, err)
	}
	path := filepath.Join(t.TempDir(), sidecar+".kubeconfig")
	if err := cp.WriteKubeconfig(path, tr.Status.Token); err != nil {
		t.Fatal(err)
	}
	return path
}

func ptrTo[T any](v T) *T { return &v }

// Each sidecar provisions, attaches or expands volumes with a token of its own
// ServiceAccount: the RBAC in deploy/ suffices for its job, leader election included.
func TestEachSidecarWorksWithItsOwnServiceAccount(t *testing.T) {
	cp := kube.Get(t)
	apply(t, cp, build(t, "example"))
	s := e2e.NewScenario(t, cp, binDir, testdriver.Config{})
	ctx := context.Background()
	store := e2e.Storage{Kube: s.Client, Namespace: s.Namespace, Class: s.Namespace, Node: s.Namespace + "-node", Driver: s.Driver.DriverName()}
	if err := store.SetUp(ctx, s.Driver.NodeID()); err != nil {
		t.Fatal(err)
	}
	leases := map[string]string{
		"provisioner": e2e.LeaseName("provisioner", store.Driver),
		"attacher":    e2e.LeaseName("attacher", store.Driver),
		"resizer":     e2e.LeaseName("resizer", store.Driver),
	}
	for _, sidecar := range []string{"provisioner", "attacher", "resizer"} {
		r := s.Start(sidecar, []string{"csi-sidecars", sidecar},
			"--kubeconfig="+token(t, cp, s.Client, sidecar), "--leader-election-namespace="+namespace)
		r.WaitReady(t)
	}
	for sidecar, lease := range leases {
		s.WaitUntil(sidecar+" holds its Lease in "+namespace, func() bool {
			l, err := s.Client.CoordinationV1().Leases(namespace).Get(ctx, lease, metav1.GetOptions{})
			return err == nil && e2e.Holder(l) == sidecar
		})
	}

	runStorageJob(ctx, t, s, store, "claim-a", "claim-b", "claim-c")

	// Events are part of the job too: the provisioner's on each claim (they share its API
	// budget, so they may come a little after the volumes).
	s.WaitUntil("a ProvisioningSucceeded event: the provisioner can write events", func() bool {
		events, err := s.Client.CoreV1().Events(s.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "reason=ProvisioningSucceeded"})
		return err == nil && len(events.Items) > 0
	})
}

// runStorageJob has the sidecars do their whole job for each claim: provision its volume,
// attach it once bound, expand it to 2Gi; it waits for each step across all claims.
func runStorageJob(ctx context.Context, t *testing.T, s *e2e.Scenario, store e2e.Storage, claims ...string) {
	t.Helper()
	n := len(claims)
	for _, claim := range claims {
		if err := store.CreateClaim(ctx, claim); err != nil {
			t.Fatal(err)
		}
	}
	waitCount(t, s, "volumes provisioned", n, func() (int, error) { pvs, err := store.Provisioned(ctx); return len(pvs), err })
	if _, err := store.BindAll(ctx); err != nil {
		t.Fatal(err)
	}
	pvs, err := store.Provisioned(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, pv := range pvs {
		if err := store.CreateAttachment(ctx, pv.Name); err != nil {
			t.Fatal(err)
		}
	}
	waitCount(t, s, "volumes attached", n, func() (int, error) { return store.Attached(ctx) })
	for _, claim := range claims {
		if err := store.Expand(ctx, claim, "2Gi"); err != nil {
			t.Fatal(err)
		}
	}
	waitCount(t, s, "volumes expanded", n, func() (int, error) { return store.Expanded(ctx, "2Gi") })
}

func waitCount(t *testing.T, s *e2e.Scenario, what string, want int, count func() (int, error)) {
	t.Helper()
	start := time.Now()
	s.WaitUntil(what, func() bool {
		n, err := count()
		return err == nil && n >= want
	})
	t.Logf("%d %s after %v", want, what, time.Since(start).Round(time.Millisecond))
}

// What no sidecar may do, and what each must be able to do, asked of the API server's
// authorizer for the sidecars' ServiceAccounts.
func TestServiceAccountsHoldLeastPrivilege(t *testing.T) {
	cp := kube.Get(t)
	apply(t, cp, build(t, "example"))
	client := kubernetes.NewForConfigOrDie(cp.Config())
	type access struct {
		verb, group, resource, subresource, namespace string
	}
	never := []access{
		{"get", "", "secrets", "", ""},
		{"list", "", "secrets", "", ""},
		{"get", "", "secrets", "", "kube-system"},
		{"delete", "", "persistentvolumeclaims", "", "default"},
		{"create", "", "pods", "", "default"},
		{"update", "", "nodes", "", ""},
		{"patch", "", "nodes", "", ""},
		{"delete", "", "nodes", "", ""},
		{"create", "rbac.authorization.k8s.io", "clusterrolebindings", "", ""},
		{"update", "coordination.k8s.io", "leases", "", "kube-system"},
		{"delete", "storage.k8s.io", "storageclasses", "", ""},
		{"create", "", "serviceaccounts", "token", namespace},
	}
	must := map[string][]access{
		"attacher": {
			{"patch", "storage.k8s.io", "volumeattachments", "status", ""},
			{"patch", "", "persistentvolumes", "", ""},
			{"update", "coordination.k8s.io", "leases", "", namespace},
		},
		"resizer": {
			{"patch", "", "persistentvolumeclaims", "status", "default"},
			{"patch", "", "persistentvolumes", "", ""},
			{"update", "coordination.k8s.io", "leases", "", namespace},
		},
		"provisioner": {
			{"create", "", "persistentvolumes", "", ""},
			{"delete", "", "persistentvolumes", "", ""},
			{"update", "coordination.k8s.io", "leases", "", namespace},
			{"create", "storage.k8s.io", "csistoragecapacities", "", namespace},
			{"update", "snapshot.storage.k8s.io", "volumesnapshots", "", "default"},
		},
	}
	notThis := map[string][]access{
		"attacher":    {{"create", "", "persistentvolumes", "", ""}, {"update", "", "persistentvolumeclaims", "", "default"}},
		"resizer":     {{"create", "", "persistentvolumes", "", ""}, {"delete", "", "persistentvolumes", "", ""}, {"update", "", "persistentvolumeclaims", "", "default"}},
		"provisioner": {{"patch", "storage.k8s.io", "volumeattachments", "", ""}, {"patch", "", "persistentvolumeclaims", "status", "default"}, {"create", "storage.k8s.io", "csistoragecapacities", "", "default"}},
	}
	allowed := func(user string, a access) bool {
		sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User:   user,
			Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"},
			ResourceAttributes: &authorizationv1.ResourceAttributes{
				Verb: a.verb, Group: a.group, Resource: a.resource, Subresource: a.subresource, Namespace: a.namespace,
			},
		}}
		out, err := client.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), sar, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return out.Status.Allowed
	}
	for _, sidecar := range []string{"attacher", "resizer", "provisioner"} {
		for _, sa := range []string{"csi-" + sidecar} {
			user := "system:serviceaccount:" + namespace + ":" + sa
			for _, a := range append(never, notThis[sidecar]...) {
				if allowed(user, a) {
					t.Errorf("%s may %s %s/%s in %q; it must not", sa, a.verb, a.resource, a.subresource, a.namespace)
				}
			}
			for _, a := range must[sidecar] {
				if !allowed(user, a) {
					t.Errorf("%s may not %s %s/%s in %q; it needs to", sa, a.verb, a.resource, a.subresource, a.namespace)
				}
			}
		}
	}
	// The example's pod ServiceAccount gets the union, and still no Secrets.
	if allowed("system:serviceaccount:"+namespace+":csi-controller", access{"get", "", "secrets", "", ""}) {
		t.Errorf("csi-controller may read Secrets cluster-wide")
	}
}
