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
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/restmapper"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/snapshotter"
)

const namespace = "csi-sidecars" // the bases' namespace

var (
	kube   controlplane.Shared
	binDir string
)

func TestMain(m *testing.M) { os.Exit(e2e.Main(m, "../../..", &kube, &binDir)) }

// sidecars are the four storage sidecars' bases in deploy/, each a sidecar's name.
var sidecars = []string{"attacher", "resizer", "provisioner", "snapshotter"}

// healthMonitor is the fifth leading sidecar, with its base in deploy/health-monitor.
const healthMonitor = "health-monitor"

// leading are the bases of all five leading sidecars in deploy/, each a sidecar's name.
var leading = append(append([]string{}, sidecars...), healthMonitor)

// controllerDriver is a test driver that takes snapshots too, as the snapshotter needs,
// and reports volume health, without which the health monitor exits 1.
func controllerDriver() testdriver.Config {
	return testdriver.Config{ControllerCapabilities: append(testdriver.DefaultControllerCapabilities(),
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT, csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH)}
}

// leaseName is sidecar's Lease for driver, as the sidecar names it.
func leaseName(sidecar, driver string) string {
	if sidecar == "snapshotter" {
		return lifecycle.SanitizeName(snapshotter.New().LeaseName(driver))
	}
	return e2e.LeaseName(sidecar, driver)
}

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
	// The example holds the namespace, the five leading sidecars' bases and deploy/node;
	// applying each again must be a no-op, and so must a second apply of everything.
	for range 2 {
		for _, dir := range append([]string{"example", "node"}, leading...) {
			apply(t, cp, build(t, dir))
		}
	}
	client := kubernetes.NewForConfigOrDie(cp.Config())
	containers := func(want int) {
		t.Helper()
		ctx := context.Background()
		d, err := client.AppsV1().Deployments(namespace).Get(ctx, "csi-controller", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if n := len(d.Spec.Template.Spec.Containers); n != want || *d.Spec.Replicas != 2 {
			t.Errorf("Deployment: %d containers, %d replicas; want %d and 2", n, *d.Spec.Replicas, want)
		}
		// The node DaemonSet comes with either, unchanged: the driver and one container.
		ds, err := client.AppsV1().DaemonSets(namespace).Get(ctx, "csi-node", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if n := len(ds.Spec.Template.Spec.Containers); n != 2 {
			t.Errorf("DaemonSet csi-node: %d containers; want 2", n)
		}
	}
	// The driver, the five leading sidecars and the livenessprobe.
	containers(7)
	// deploy/combined keeps the Deployment's name, so applying it over the example switches
	// the cluster to combined mode in place (the six sidecar containers go, one comes),
	// and applying the example again switches back: the same field manager owns both.
	for range 2 {
		apply(t, cp, build(t, "combined"))
	}
	containers(2)
	apply(t, cp, build(t, "example"))
	containers(7)
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

// Each sidecar provisions, attaches, expands volumes, snapshots them or records their
// health with a token of its own ServiceAccount: the RBAC in deploy/ suffices for its job,
// leader election included.
func TestEachSidecarWorksWithItsOwnServiceAccount(t *testing.T) {
	cp := kube.Get(t)
	apply(t, cp, build(t, "example"))
	s := e2e.NewScenario(t, cp, binDir, controllerDriver())
	snaps := installSnapshotCRDs(t, s)
	ctx := context.Background()
	store := s.SetUpStorage(nil)
	replicas := map[string]*e2e.Replica{}
	for _, sidecar := range leading {
		args := []string{"--kubeconfig=" + token(t, cp, s.Client, sidecar), "--leader-election-namespace=" + namespace}
		if sidecar == healthMonitor {
			// A pass a second, not every 5 minutes: the test waits for one after a change.
			args = append(args, "--list-volumes-interval=1s")
		}
		r := s.Start(sidecar, []string{"csi-sidecars", sidecar}, args...)
		r.WaitReady(t)
		replicas[sidecar] = r
	}
	for _, sidecar := range leading {
		lease := leaseName(sidecar, store.Driver)
		s.WaitUntil(sidecar+" holds its Lease in "+namespace, func() bool {
			l, err := s.Client.CoordinationV1().Leases(namespace).Get(ctx, lease, metav1.GetOptions{})
			return err == nil && e2e.Holder(l) == sidecar
		})
	}

	runStorageJob(ctx, t, s, store, "claim-a", "claim-b", "claim-c")
	runSnapshotJob(ctx, t, s, snaps, store)
	// The snapshotter's least privilege is enough for all it does, the group snapshot
	// CRDs' check and the caches of both kinds included: no request of it was refused.
	e2e.NoForbidden(t, replicas["snapshotter"])

	// Events are part of the job too: the provisioner's on each claim (they share its API
	// budget, so they may come a little after the volumes).
	s.WaitUntil("a ProvisioningSucceeded event: the provisioner can write events", func() bool {
		events, err := s.Client.CoreV1().Events(s.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "reason=ProvisioningSucceeded"})
		return err == nil && len(events.Items) > 0
	})

	// The health monitor records a volume's trouble on its claim: in status.healthStatus
	// where the API server keeps it, else as a VolumeConditionAbnormal event.
	markUnhealthy(ctx, t, s, store, "claim-b")
	waitHealthRecorded(ctx, s, "claim-b")
	e2e.NoForbidden(t, replicas[healthMonitor])
}

// markUnhealthy has the driver report claim's volume as degraded from now on.
func markUnhealthy(ctx context.Context, t *testing.T, s *e2e.Scenario, store e2e.Storage, claim string) {
	t.Helper()
	pvs, err := store.Provisioned(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, pv := range pvs {
		if pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Name == claim {
			if err := s.Driver.SetVolumeHealth(pv.Spec.CSI.VolumeHandle, testdriver.HealthCondition{
				Status: csi.VolumeHealthErrorType_DEGRADED, Reason: "ReplicaLost", Message: "one replica of three is lost"}); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	t.Fatalf("no volume of claim %s", claim)
}

// waitHealthRecorded waits until the health monitor recorded claim's degraded volume: in
// the claim's status.healthStatus, or as a VolumeConditionAbnormal event on it.
func waitHealthRecorded(ctx context.Context, s *e2e.Scenario, claim string) {
	s.WaitUntil("claim "+claim+"'s degraded volume recorded on it", func() bool {
		pvc, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Get(ctx, claim, metav1.GetOptions{})
		if err == nil && pvc.Status.HealthStatus != nil && len(pvc.Status.HealthStatus.HealthConditions) > 0 {
			return true
		}
		events, err := s.Client.CoreV1().Events(s.Namespace).List(ctx, metav1.ListOptions{
			FieldSelector: "reason=VolumeConditionAbnormal,involvedObject.name=" + claim})
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

// installSnapshotCRDs installs the snapshot and group snapshot CRDs of the
// external-snapshotter client module (server-side apply, so again is a no-op) and waits
// until they are served.
func installSnapshotCRDs(t *testing.T, s *e2e.Scenario) snapclientset.Interface {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/kubernetes-csi/external-snapshotter/client/v8").Output()
	if err != nil {
		t.Fatalf("locating the external-snapshotter client module: %v", err)
	}
	dir := filepath.Join(strings.TrimSpace(string(out)), "config", "crd")
	var crds []*unstructured.Unstructured
	for _, name := range []string{
		"snapshot.storage.k8s.io_volumesnapshotclasses", "snapshot.storage.k8s.io_volumesnapshotcontents",
		"snapshot.storage.k8s.io_volumesnapshots", "groupsnapshot.storage.k8s.io_volumegroupsnapshotclasses",
		"groupsnapshot.storage.k8s.io_volumegroupsnapshotcontents", "groupsnapshot.storage.k8s.io_volumegroupsnapshots",
	} {
		data, err := os.ReadFile(filepath.Join(dir, name+".yaml"))
		if err != nil {
			t.Fatal(err)
		}
		crd := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(data, &crd.Object); err != nil {
			t.Fatalf("parsing the %s CRD: %v", name, err)
		}
		crds = append(crds, crd)
	}
	apply(t, s.CP, crds)
	client := snapclientset.NewForConfigOrDie(s.CP.Config())
	s.WaitUntil("the snapshot and group snapshot APIs", func() bool {
		_, err := client.SnapshotV1().VolumeSnapshotContents().List(context.Background(), metav1.ListOptions{Limit: 1})
		_, err2 := client.GroupsnapshotV1().VolumeGroupSnapshotContents().List(context.Background(), metav1.ListOptions{Limit: 1})
		return err == nil && err2 == nil
	})
	return client
}

// runSnapshotJob has the snapshotter snapshot every volume the store provisioned: a class
// of the driver and, per volume, the VolumeSnapshotContent the snapshot-controller would
// create for a dynamic VolumeSnapshot (the snapshotter reads only the content, so none is
// created); it waits until each content records a ready snapshot, and returns them.
func runSnapshotJob(ctx context.Context, t *testing.T, s *e2e.Scenario, snaps snapclientset.Interface, store e2e.Storage, classParams ...map[string]string) []snapv1.VolumeSnapshotContent {
	t.Helper()
	pvs, err := store.Provisioned(ctx)
	if err != nil {
		t.Fatal(err)
	}
	class := s.Namespace
	if _, err := snaps.SnapshotV1().VolumeSnapshotClasses().Create(ctx, &snapv1.VolumeSnapshotClass{
		ObjectMeta: metav1.ObjectMeta{Name: class}, Driver: store.Driver, DeletionPolicy: snapv1.VolumeSnapshotContentDelete,
		Parameters: firstOf(classParams),
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, pv := range pvs {
		content := &snapv1.VolumeSnapshotContent{
			ObjectMeta: metav1.ObjectMeta{Name: s.Namespace + "-" + pv.Name, Annotations: snapshotterSecretOf(firstOf(classParams))},
			Spec: snapv1.VolumeSnapshotContentSpec{
				Driver:                  store.Driver,
				DeletionPolicy:          snapv1.VolumeSnapshotContentDelete,
				Source:                  snapv1.VolumeSnapshotContentSource{VolumeHandle: &pv.Spec.CSI.VolumeHandle},
				VolumeSnapshotClassName: &class,
				// The snapshot's UID names the driver's snapshot: the volume's stands in.
				VolumeSnapshotRef: corev1.ObjectReference{Kind: "VolumeSnapshot", Namespace: s.Namespace, Name: "snap-" + pv.Name, UID: pv.UID},
			},
		}
		if _, err := snaps.SnapshotV1().VolumeSnapshotContents().Create(ctx, content, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		names[content.Name] = true
	}
	var ready []snapv1.VolumeSnapshotContent
	waitCount(t, s, "snapshots ready", len(pvs), func() (int, error) {
		list, err := snaps.SnapshotV1().VolumeSnapshotContents().List(ctx, metav1.ListOptions{})
		if err != nil {
			return 0, err
		}
		ready = ready[:0]
		for _, c := range list.Items {
			if st := c.Status; names[c.Name] && st != nil && st.SnapshotHandle != nil && st.ReadyToUse != nil && *st.ReadyToUse {
				ready = append(ready, c)
			}
		}
		return len(ready), nil
	})
	return ready
}

// snapshotterSecretOf is what the snapshot-controller annotates on a content for a class's
// snapshotter secret (the snapshotter reads the secret from there, as upstream's).
func snapshotterSecretOf(classParams map[string]string) map[string]string {
	name, ok := classParams["csi.storage.k8s.io/snapshotter-secret-name"]
	if !ok {
		return nil
	}
	return map[string]string{
		"snapshot.storage.kubernetes.io/deletion-secret-name":      name,
		"snapshot.storage.kubernetes.io/deletion-secret-namespace": classParams["csi.storage.k8s.io/snapshotter-secret-namespace"],
	}
}

func firstOf(params []map[string]string) map[string]string {
	if len(params) == 0 {
		return nil
	}
	return params[0]
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
// authorizer for the sidecars' ServiceAccounts; the node pod's may do nothing at all and
// gets no token.
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
		// Everything the snapshotter does: classes and contents read and watched, contents
		// and their status patched, for both kinds; events on contents (cluster-scoped, so
		// in "default") and on its Lease; the Lease itself.
		"snapshotter": {
			{"get", "snapshot.storage.k8s.io", "volumesnapshotclasses", "", ""},
			{"list", "snapshot.storage.k8s.io", "volumesnapshotclasses", "", ""},
			{"watch", "snapshot.storage.k8s.io", "volumesnapshotclasses", "", ""},
			{"get", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", ""},
			{"list", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", ""},
			{"watch", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", ""},
			{"patch", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", ""},
			{"patch", "snapshot.storage.k8s.io", "volumesnapshotcontents", "status", ""},
			{"get", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotclasses", "", ""},
			{"list", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotclasses", "", ""},
			{"watch", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotclasses", "", ""},
			{"get", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "", ""},
			{"list", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "", ""},
			{"watch", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "", ""},
			{"patch", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "", ""},
			{"patch", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "status", ""},
			{"create", "", "events", "", "default"},
			{"patch", "", "events", "", "default"},
			{"create", "", "events", "", namespace},
			{"get", "coordination.k8s.io", "leases", "", namespace},
			{"list", "coordination.k8s.io", "leases", "", namespace},
			{"watch", "coordination.k8s.io", "leases", "", namespace},
			{"create", "coordination.k8s.io", "leases", "", namespace},
			{"update", "coordination.k8s.io", "leases", "", namespace},
		},
		// deploy/health-monitor's rules: volumes, claims, nodes and Pods listed and watched;
		// only the claims' status patched; events created and patched; its Lease.
		healthMonitor: {
			{"list", "", "persistentvolumes", "", ""},
			{"watch", "", "persistentvolumes", "", ""},
			{"list", "", "persistentvolumeclaims", "", ""},
			{"watch", "", "persistentvolumeclaims", "", ""},
			{"patch", "", "persistentvolumeclaims", "status", "default"},
			{"list", "", "nodes", "", ""},
			{"watch", "", "nodes", "", ""},
			{"list", "", "pods", "", ""},
			{"watch", "", "pods", "", ""},
			{"create", "", "events", "", "default"},
			{"patch", "", "events", "", "default"},
			{"get", "coordination.k8s.io", "leases", "", namespace},
			{"list", "coordination.k8s.io", "leases", "", namespace},
			{"watch", "coordination.k8s.io", "leases", "", namespace},
			{"create", "coordination.k8s.io", "leases", "", namespace},
			{"update", "coordination.k8s.io", "leases", "", namespace},
		},
	}
	notThis := map[string][]access{
		"attacher":    {{"create", "", "persistentvolumes", "", ""}, {"update", "", "persistentvolumeclaims", "", "default"}},
		"resizer":     {{"create", "", "persistentvolumes", "", ""}, {"delete", "", "persistentvolumes", "", ""}, {"update", "", "persistentvolumeclaims", "", "default"}},
		"provisioner": {{"patch", "storage.k8s.io", "volumeattachments", "", ""}, {"patch", "", "persistentvolumeclaims", "status", "default"}, {"create", "storage.k8s.io", "csistoragecapacities", "", "default"}, {"patch", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", ""}},
		// Contents are created and deleted by the snapshot-controller and written here by
		// patch only; VolumeSnapshots, volumes, claims and Secrets are none of its business;
		// the event recorder creates and patches, never reads or updates.
		"snapshotter": {
			{"create", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", ""},
			{"delete", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", ""},
			{"deletecollection", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", ""},
			{"update", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", ""},
			{"update", "snapshot.storage.k8s.io", "volumesnapshotcontents", "status", ""},
			{"create", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "", ""},
			{"delete", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "", ""},
			{"update", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "", ""},
			{"update", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "status", ""},
			{"create", "snapshot.storage.k8s.io", "volumesnapshotclasses", "", ""},
			{"patch", "snapshot.storage.k8s.io", "volumesnapshotclasses", "", ""},
			{"patch", "groupsnapshot.storage.k8s.io", "volumegroupsnapshotclasses", "", ""},
			{"get", "snapshot.storage.k8s.io", "volumesnapshots", "", "default"},
			{"list", "snapshot.storage.k8s.io", "volumesnapshots", "", ""},
			{"watch", "snapshot.storage.k8s.io", "volumesnapshots", "", ""},
			{"create", "snapshot.storage.k8s.io", "volumesnapshots", "", "default"},
			{"update", "snapshot.storage.k8s.io", "volumesnapshots", "", "default"},
			{"patch", "snapshot.storage.k8s.io", "volumesnapshots", "status", "default"},
			{"delete", "snapshot.storage.k8s.io", "volumesnapshots", "", "default"},
			{"get", "groupsnapshot.storage.k8s.io", "volumegroupsnapshots", "", "default"},
			{"update", "groupsnapshot.storage.k8s.io", "volumegroupsnapshots", "", "default"},
			{"get", "", "secrets", "", "default"},
			{"update", "", "secrets", "", "default"},
			{"update", "", "secrets", "", ""},
			{"get", "", "persistentvolumes", "", ""},
			{"patch", "", "persistentvolumes", "", ""},
			{"get", "", "persistentvolumeclaims", "", "default"},
			{"list", "", "events", "", "default"},
			{"watch", "", "events", "", ""},
			{"update", "", "events", "", "default"},
			{"delete", "", "events", "", "default"},
			{"delete", "coordination.k8s.io", "leases", "", namespace},
		},
		// It reads from its caches and writes only a claim's status and events: no single
		// gets, no writes of volumes, claims or their specs, no reading of events, no
		// other sidecar's objects.
		healthMonitor: {
			{"get", "", "persistentvolumes", "", ""},
			{"patch", "", "persistentvolumes", "", ""},
			{"create", "", "persistentvolumes", "", ""},
			{"get", "", "persistentvolumeclaims", "", "default"},
			{"patch", "", "persistentvolumeclaims", "", "default"},
			{"update", "", "persistentvolumeclaims", "status", "default"},
			{"get", "", "pods", "", "default"},
			{"get", "", "nodes", "", ""},
			{"list", "", "events", "", "default"},
			{"update", "", "events", "", "default"},
			{"get", "", "secrets", "", "default"},
			{"patch", "storage.k8s.io", "volumeattachments", "", ""},
			{"patch", "snapshot.storage.k8s.io", "volumesnapshotcontents", "", ""},
			{"delete", "coordination.k8s.io", "leases", "", namespace},
		},
	}
	// The node pod's registrar and probe talk to the kubelet and the driver only: its
	// ServiceAccount may do nothing of what any sidecar does, nor read what a node agent
	// might want to.
	nodeNever := append(append([]access{}, never...),
		access{"get", "", "pods", "", "default"},
		access{"list", "", "pods", "", ""},
		access{"get", "", "nodes", "", ""},
		access{"list", "", "nodes", "", ""},
		access{"watch", "", "nodes", "", ""},
		access{"get", "storage.k8s.io", "csinodes", "", ""},
		access{"update", "storage.k8s.io", "csinodes", "", ""},
		access{"get", "storage.k8s.io", "csidrivers", "", ""},
		access{"list", "", "persistentvolumes", "", ""},
		access{"get", "", "persistentvolumeclaims", "", "default"},
		access{"list", "storage.k8s.io", "volumeattachments", "", ""},
		access{"create", "", "events", "", namespace},
		access{"create", "", "events", "", "default"},
		access{"get", "coordination.k8s.io", "leases", "", namespace},
		access{"create", "coordination.k8s.io", "leases", "", namespace},
		access{"get", "", "configmaps", "", namespace},
		access{"get", "", "serviceaccounts", "", namespace},
		access{"get", "", "secrets", "", namespace},
	)
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
	for _, sidecar := range leading {
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
	// The example's pod ServiceAccount gets the union, and still nothing of never.
	controller := "system:serviceaccount:" + namespace + ":csi-controller"
	for _, sidecar := range leading {
		for _, a := range must[sidecar] {
			if !allowed(controller, a) {
				t.Errorf("csi-controller may not %s %s/%s in %q; its %s needs to", a.verb, a.resource, a.subresource, a.namespace, sidecar)
			}
		}
	}
	for _, a := range never {
		if allowed(controller, a) {
			t.Errorf("csi-controller may %s %s/%s in %q; it must not", a.verb, a.resource, a.subresource, a.namespace)
		}
	}

	node := "system:serviceaccount:" + namespace + ":csi-node"
	for _, a := range nodeNever {
		if allowed(node, a) {
			t.Errorf("csi-node may %s %s/%s in %q; it must not", a.verb, a.resource, a.subresource, a.namespace)
		}
	}
	// Nor is its token in the pod: neither the ServiceAccount nor the pod mounts one.
	ctx := context.Background()
	sa, err := client.CoreV1().ServiceAccounts(namespace).Get(ctx, "csi-node", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if m := sa.AutomountServiceAccountToken; m == nil || *m {
		t.Errorf("ServiceAccount csi-node: automountServiceAccountToken %s; want false", unsetOr(m))
	}
	ds, err := client.AppsV1().DaemonSets(namespace).Get(ctx, "csi-node", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod := ds.Spec.Template.Spec; pod.ServiceAccountName != "csi-node" || pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		t.Errorf("DaemonSet csi-node: pod of ServiceAccount %q, automountServiceAccountToken %s; want csi-node and false",
			pod.ServiceAccountName, unsetOr(pod.AutomountServiceAccountToken))
	}
}

// unsetOr is *b as text, "unset" if nil.
func unsetOr(b *bool) string {
	if b == nil {
		return "unset"
	}
	return strconv.FormatBool(*b)
}
