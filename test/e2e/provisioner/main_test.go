// Package provisioner runs `csi-sidecars provisioner` processes against a real
// kube-apiserver and the project's test CSI driver: provisioning and deletion as
// external-provisioner does them, and the lifecycle promises on slow CreateVolume calls
// (every volume the driver creates ends as exactly one PersistentVolume, P1).
//
// No kube-controller-manager or scheduler runs: the tests do what they would (select a
// node for WaitForFirstConsumer claims, mark PersistentVolumes Released) and check the
// PersistentVolume's claimRef rather than the claim's binding.
package provisioner

import (
	"context"
	"fmt"
	"maps"
	"os"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

var (
	kube   controlplane.Shared
	binDir string
)

// The API server keeps a claim's dataSourceRef.namespace only with its own
// CrossNamespaceVolumeDataSource gate on (crossns_test.go); no other test names one.
func TestMain(m *testing.M) {
	os.Exit(e2e.MainWith(m, "../../..", &kube, &binDir, controlplane.Options{
		APIServerArgs: []string{"--feature-gates=CrossNamespaceVolumeDataSource=true"},
	}))
}

// scenario is one test's world with the provisioner's Lease name.
type scenario struct {
	*e2e.Scenario
	leaseName string
	driver    string
}

func newScenario(t testing.TB, cfg testdriver.Config) *scenario {
	s := e2e.NewScenario(t, kube.Get(t), binDir, cfg)
	driver := s.Driver.DriverName()
	// Cluster-scoped objects of the test are named after its namespace; remove them after.
	t.Cleanup(func() { cleanupClusterObjects(s) })
	return &scenario{Scenario: s, driver: driver, leaseName: e2e.LeaseName("provisioner", driver)}
}

// startReplica runs `csi-sidecars provisioner` with fast retries and an API rate limit that
// does not slow 50 claims down.
func (s *scenario) startReplica(name string, extra ...string) *e2e.Replica {
	s.T.Helper()
	args := append([]string{"--kube-api-qps=200", "--kube-api-burst=400", "--retry-interval-start=100ms", "--retry-interval-max=2s"}, extra...)
	return s.Start(name, []string{"csi-sidecars", "provisioner"}, args...)
}

func (s *scenario) ctx() context.Context { return context.Background() }

func (s *scenario) name(suffix string) string { return s.Namespace + "-" + suffix }

// createClass creates a StorageClass of the driver named <namespace>-<suffix>.
func (s *scenario) createClass(suffix string, change func(*storagev1.StorageClass)) *storagev1.StorageClass {
	s.T.Helper()
	sc := &storagev1.StorageClass{
		ObjectMeta:    metav1.ObjectMeta{Name: s.name(suffix)},
		Provisioner:   s.driver,
		ReclaimPolicy: ptr.To(v1.PersistentVolumeReclaimDelete),
		Parameters:    map[string]string{"type": suffix},
	}
	if change != nil {
		change(sc)
	}
	sc, err := s.Client.StorageV1().StorageClasses().Create(s.ctx(), sc, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return sc
}

// createNode creates a Node and its CSINode as kubelet and the node plugin would: the
// driver's topology key labels the node with the node's name.
func (s *scenario) createNode(suffix string) string {
	s.T.Helper()
	return s.createNodeWith(suffix, nil, testdriver.TopologyKey)
}

// createNodeWith creates a Node labelled with the driver's topology key (the node's name)
// and labels, and its CSINode, which registers keys for the driver; with no keys the
// driver is not on the node.
func (s *scenario) createNodeWith(suffix string, labels map[string]string, keys ...string) string {
	s.T.Helper()
	name := s.name(suffix)
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{testdriver.TopologyKey: name}}}
	maps.Copy(node.Labels, labels)
	if _, err := s.Client.CoreV1().Nodes().Create(s.ctx(), node, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	csiNode := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if len(keys) > 0 {
		csiNode.Spec.Drivers = []storagev1.CSINodeDriver{{Name: s.driver, NodeID: name, TopologyKeys: keys}}
	}
	if _, err := s.Client.StorageV1().CSINodes().Create(s.ctx(), csiNode, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	return name
}

// createClaim creates a claim of the class as the PV controller hands it over (the
// storage-provisioner annotation set) and, for delayed binding, as the scheduler selects
// a node.
func (s *scenario) createClaim(name, class, selectedNode string) *v1.PersistentVolumeClaim {
	s.T.Helper()
	return s.createClaimAnnotated(name, class, selectedNode, nil)
}

// createClaimAnnotated is createClaim with extra annotations.
func (s *scenario) createClaimAnnotated(name, class, selectedNode string, annotations map[string]string) *v1.PersistentVolumeClaim {
	s.T.Helper()
	claim := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{volumehelpers.AnnStorageProvisioner: s.driver}},
		Spec: v1.PersistentVolumeClaimSpec{
			AccessModes:      []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			StorageClassName: &class,
			Resources:        v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	for k, v := range annotations {
		claim.Annotations[k] = v
	}
	if selectedNode != "" {
		claim.Annotations[volumehelpers.AnnSelectedNode] = selectedNode
	}
	claim, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Create(s.ctx(), claim, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return claim
}

func (s *scenario) createSecret(name string) {
	s.T.Helper()
	secret := &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name}, Data: map[string][]byte{"token": []byte(name)}}
	if _, err := s.Client.CoreV1().Secrets(s.Namespace).Create(s.ctx(), secret, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
}

// pvs returns the PersistentVolumes of the scenario's driver by name.
func (s *scenario) pvs() map[string]*v1.PersistentVolume {
	s.T.Helper()
	list, err := s.Client.CoreV1().PersistentVolumes().List(s.ctx(), metav1.ListOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	out := map[string]*v1.PersistentVolume{}
	for i := range list.Items {
		pv := &list.Items[i]
		if pv.Spec.CSI != nil && pv.Spec.CSI.Driver == s.driver {
			out[pv.Name] = pv
		}
	}
	return out
}

// pvsByClaim maps claim UIDs to the PersistentVolumes whose claimRef names them.
func (s *scenario) pvsByClaim() map[types.UID][]*v1.PersistentVolume {
	out := map[types.UID][]*v1.PersistentVolume{}
	for _, pv := range s.pvs() {
		if pv.Spec.ClaimRef != nil {
			out[pv.Spec.ClaimRef.UID] = append(out[pv.Spec.ClaimRef.UID], pv)
		}
	}
	return out
}

// waitForPVs waits until n PersistentVolumes of the driver exist.
func (s *scenario) waitForPVs(n int) {
	s.T.Helper()
	s.WaitUntil(fmt.Sprintf("%d PersistentVolumes", n), func() bool { return len(s.pvs()) >= n })
}

// markReleased does what the PV controller does once a claim is gone.
func (s *scenario) markReleased(pv *v1.PersistentVolume) {
	s.T.Helper()
	pv = pv.DeepCopy()
	pv.Status.Phase = v1.VolumeReleased
	if _, err := s.Client.CoreV1().PersistentVolumes().UpdateStatus(s.ctx(), pv, metav1.UpdateOptions{}); err != nil {
		s.T.Fatal(err)
	}
}

// events returns the messages of the events about an object of the namespace.
func (s *scenario) events(object, reason string) []string {
	s.T.Helper()
	list, err := s.Client.CoreV1().Events(s.Namespace).List(s.ctx(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + object})
	if err != nil {
		s.T.Fatal(err)
	}
	var out []string
	for _, e := range list.Items {
		if e.Reason == reason {
			out = append(out, e.Message)
		}
	}
	return out
}

// createCalls returns the CreateVolume calls of the journal.
func createCalls(calls []testdriver.Call) []testdriver.Call {
	var out []testdriver.Call
	for _, c := range calls {
		if c.Method == testdriver.MethodCreateVolume {
			out = append(out, c)
		}
	}
	return out
}

// checkEveryVolumeHasExactlyOnePV asserts that every volume the driver holds is recorded
// by exactly one PersistentVolume and every name CreateVolume was called with ended as
// exactly one PersistentVolume.
func (s *scenario) checkEveryVolumeHasExactlyOnePV() {
	s.T.Helper()
	pvs := s.pvs()
	byHandle := map[string][]string{}
	for _, pv := range pvs {
		byHandle[pv.Spec.CSI.VolumeHandle] = append(byHandle[pv.Spec.CSI.VolumeHandle], pv.Name)
	}
	for _, v := range s.Driver.Volumes() {
		switch names := byHandle[v.ID]; len(names) {
		case 0:
			s.T.Errorf("volume %s (%s) is in the driver without a PersistentVolume", v.ID, v.Name)
		case 1:
			if names[0] != v.Name {
				s.T.Errorf("volume %s named %s is recorded by PersistentVolume %s", v.ID, v.Name, names[0])
			}
		default:
			s.T.Errorf("volume %s is recorded by %d PersistentVolumes: %v", v.ID, len(names), names)
		}
	}
	started := map[string]bool{}
	for _, c := range createCalls(s.Driver.Journal()) {
		started[c.VolumeName] = true
	}
	for name := range started {
		if pvs[name] == nil {
			s.T.Errorf("CreateVolume was called for %s but no PersistentVolume records it", name)
		}
	}
}

func cleanupClusterObjects(s *e2e.Scenario) {
	ctx := context.Background()
	prefix := s.Namespace + "-"
	if list, err := s.Client.StorageV1().StorageClasses().List(ctx, metav1.ListOptions{}); err == nil {
		for _, sc := range list.Items {
			if strings.HasPrefix(sc.Name, prefix) {
				_ = s.Client.StorageV1().StorageClasses().Delete(ctx, sc.Name, metav1.DeleteOptions{})
			}
		}
	}
	if list, err := s.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err == nil {
		for _, n := range list.Items {
			if strings.HasPrefix(n.Name, prefix) {
				_ = s.Client.CoreV1().Nodes().Delete(ctx, n.Name, metav1.DeleteOptions{})
				_ = s.Client.StorageV1().CSINodes().Delete(ctx, n.Name, metav1.DeleteOptions{})
			}
		}
	}
}

// slow is the CreateVolume latency of the failover tests: long enough to signal a replica
// while calls are in flight, short enough to keep the tests to seconds.
const slow = 2 * time.Second
