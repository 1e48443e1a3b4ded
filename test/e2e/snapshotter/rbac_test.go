package snapshotter

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"sigs.k8s.io/yaml"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/snapshotcontroller"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// upstreamRBACPath is upstream's RBAC file for csi-snapshotter, in external-snapshotter's
// module (release snapshotcontroller.Version).
const upstreamRBACPath = "deploy/kubernetes/csi-snapshotter/rbac-csi-snapshotter.yaml"

// upstreamRBAC is a verbatim copy of upstreamRBACPath of external-snapshotter v8.7.0: the
// ServiceAccount csi-snapshotter, the ClusterRole external-snapshotter-runner (events, the
// snapshot and group snapshot classes and contents; the Secrets rule is commented out) and
// the Role external-snapshotter-leaderelection (the Leases), with their bindings.
// TestUpstreamRBACCopyIsVerbatim checks it against the module's file where the module
// cache has it.
const upstreamRBAC = `# Together with the RBAC file for external-provisioner, this YAML file
# contains all RBAC objects that are necessary to run external CSI
# snapshotter.
#
# In production, each CSI driver deployment has to be customized:
# - to avoid conflicts, use non-default namespace and different names
#   for non-namespaced entities like the ClusterRole
# - optionally rename the non-namespaced ClusterRole if there
#   are conflicts with other deployments

---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: csi-snapshotter

---
kind: ClusterRole
apiVersion: rbac.authorization.k8s.io/v1
metadata:
  # rename if there are conflicts
  name: external-snapshotter-runner
rules:
  - apiGroups: [""]
    resources: ["events"]
    verbs: ["list", "watch", "create", "update", "patch"]
  # Secret permission is optional.
  # Enable it if your driver needs secret.
  # For example, ` + "`csi.storage.k8s.io/snapshotter-secret-name`" + ` is set in VolumeSnapshotClass.
  # See https://kubernetes-csi.github.io/docs/secrets-and-credentials.html for more details.
  #  - apiGroups: [""]
  #    resources: ["secrets"]
  #    verbs: ["get", "list"]
  - apiGroups: ["snapshot.storage.k8s.io"]
    resources: ["volumesnapshotclasses"]
    verbs: ["get", "list", "watch"]
  - apiGroups: ["snapshot.storage.k8s.io"]
    resources: ["volumesnapshotcontents"]
    verbs: ["get", "list", "watch", "update", "patch"]
  - apiGroups: ["snapshot.storage.k8s.io"]
    resources: ["volumesnapshotcontents/status"]
    verbs: ["update", "patch"]
  - apiGroups: ["groupsnapshot.storage.k8s.io"]
    resources: ["volumegroupsnapshotclasses"]
    verbs: ["get", "list", "watch"]
  - apiGroups: ["groupsnapshot.storage.k8s.io"]
    resources: ["volumegroupsnapshotcontents"]
    verbs: ["get", "list", "watch", "update", "patch"]
  - apiGroups: ["groupsnapshot.storage.k8s.io"]
    resources: ["volumegroupsnapshotcontents/status"]
    verbs: ["update", "patch"]
---
kind: ClusterRoleBinding
apiVersion: rbac.authorization.k8s.io/v1
metadata:
  name: csi-snapshotter-role
subjects:
  - kind: ServiceAccount
    name: csi-snapshotter
    # replace with non-default namespace name
    namespace: default
roleRef:
  kind: ClusterRole
  # change the name also here if the ClusterRole gets renamed
  name: external-snapshotter-runner
  apiGroup: rbac.authorization.k8s.io

---
kind: Role
apiVersion: rbac.authorization.k8s.io/v1
metadata:
  namespace: default # TODO: replace with the namespace you want for your sidecar
  name: external-snapshotter-leaderelection
rules:
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "watch", "list", "delete", "update", "create"]

---
kind: RoleBinding
apiVersion: rbac.authorization.k8s.io/v1
metadata:
  name: external-snapshotter-leaderelection
  namespace: default # TODO: replace with the namespace you want for your sidecar
subjects:
  - kind: ServiceAccount
    name: csi-snapshotter
    namespace: default # TODO: replace with the namespace you want for your sidecar
roleRef:
  kind: Role
  name: external-snapshotter-leaderelection
  apiGroup: rbac.authorization.k8s.io

`

// upstreamSnapshotterRules are the rules of upstreamRBAC: the ClusterRole's, and the Role's
// in the leader-election namespace, read from the YAML itself rather than retyped.
func upstreamSnapshotterRules(t testing.TB) e2e.Rules {
	t.Helper()
	var rules e2e.Rules
	roles := 0
	for _, doc := range strings.Split(upstreamRBAC, "\n---\n") {
		var obj struct {
			Kind  string              `json:"kind"`
			Rules []rbacv1.PolicyRule `json:"rules"`
		}
		if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
			t.Fatalf("upstream's RBAC: %v", err)
		}
		switch obj.Kind {
		case "ClusterRole":
			rules.Cluster = obj.Rules
			roles++
		case "Role":
			rules.Namespace = obj.Rules
			roles++
		}
	}
	if roles != 2 || len(rules.Cluster) != 7 || len(rules.Namespace) != 1 {
		t.Fatalf("upstream's RBAC: %d roles, %d cluster rules, %d namespace rules; want 2, 7, 1", roles, len(rules.Cluster), len(rules.Namespace))
	}
	for _, r := range rules.Cluster {
		for _, res := range r.Resources {
			if res == "secrets" {
				t.Fatal("upstream's RBAC grants Secrets: its rule is commented out in v8.7.0")
			}
		}
	}
	return rules
}

// The copy is upstream's file, byte for byte, when the module cache holds external-snapshotter
// (hack/snapshot-controller's module requires it); elsewhere there is nothing to compare with.
func TestUpstreamRBACCopyIsVerbatim(t *testing.T) {
	cache := os.Getenv("GOMODCACHE")
	if cache == "" {
		gopath := os.Getenv("GOPATH")
		if gopath == "" {
			home, _ := os.UserHomeDir()
			gopath = filepath.Join(home, "go")
		}
		cache = filepath.Join(filepath.SplitList(gopath)[0], "pkg", "mod")
	}
	path := filepath.Join(cache, "github.com", "kubernetes-csi", "external-snapshotter", "v8@"+snapshotcontroller.Version, upstreamRBACPath)
	data, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		t.Skipf("%s is not in the module cache", path)
	}
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(data, []byte(upstreamRBAC)) {
		t.Errorf("upstreamRBAC differs from %s: copy it again", path)
	}
	upstreamSnapshotterRules(t)
}

// Upstream's own RBAC is enough: with a token of a ServiceAccount that holds exactly the
// rules of csi-snapshotter v8.7.0's rbac-csi-snapshotter.yaml, the snapshotter takes and
// deletes snapshots and a group snapshot, records a failure as an event, takes and releases
// its Lease, and no request of it is refused.
func TestUpstreamRBACIsEnoughToSnapshotAndDelete(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	claims := s.claims(4)
	s.labelClaims("db", claims[2:]...)
	groupClass := s.groupClass(nil)
	// The first CreateSnapshot fails once: the failure goes on the content and into an event.
	if err := s.Driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateSnapshot, Code: codes.Internal, Times: 1}); err != nil {
		t.Fatal(err)
	}
	r := s.start("replica-a", "--kubeconfig="+s.KubeconfigWithRules("csi-snapshotter", upstreamSnapshotterRules(t)))
	s.WaitForHolder(s.leaseName, "replica-a")
	r.WaitReady(t)

	s.snapshot("snap-0", claims[0])
	s.snapshot("snap-1", claims[1])
	s.waitReady("snap-0", "snap-1")
	s.volumeGroupSnapshot("db", groupClass, "db")
	s.waitGroupReady("db")
	s.WaitUntil("4 VolumeSnapshots ready (2 of the group)", func() bool {
		n := 0
		for _, vs := range s.volumeSnapshots() {
			if vs.Status != nil && vs.Status.ReadyToUse != nil && *vs.Status.ReadyToUse {
				n++
			}
		}
		return n == 4
	})
	if n, g := len(s.Driver.Snapshots()), len(s.Driver.GroupSnapshots()); n != 4 || g != 1 {
		t.Errorf("backend holds %d snapshots and %d group snapshots, want 4 and 1", n, g)
	}
	// The failure's event, written under upstream's events rule (content events go to the
	// default namespace, the content being cluster-scoped).
	source := "csi-snapshotter " + s.Driver.DriverName()
	s.WaitUntil("the CreateSnapshot failure recorded as an event", func() bool {
		events, err := s.Client.CoreV1().Events(metav1.NamespaceDefault).List(s.ctx(), metav1.ListOptions{
			FieldSelector: fields.Set{"source": source, "reason": "SnapshotCreationFailed"}.String()})
		return err == nil && len(events.Items) > 0
	})

	s.deleteSnapshot("snap-0")
	s.deleteSnapshot("snap-1")
	s.deleteVolumeGroupSnapshot("db")
	s.waitGroupGone()

	signalled := r.Signal(t, syscall.SIGTERM)
	if code := r.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("exit code %d after SIGTERM, want 0", code)
	}
	if h := e2e.Holder(s.Lease(s.leaseName)); h != "" {
		t.Errorf("Lease held by %q after the exit, want it released", h)
	}
	t.Logf("exited %v after SIGTERM", r.ExitedAt.Sub(signalled).Round(time.Millisecond))
	e2e.NoForbidden(t, r)
	for _, line := range strings.Split(r.Stderr(), "\n") {
		if strings.Contains(line, "RBAC does not allow") {
			t.Errorf("%s: %s", r.Name, line)
		}
	}
	if n := len(s.Driver.Overlaps()); n != 0 {
		t.Errorf("%d overlapping calls", n)
	}
}
