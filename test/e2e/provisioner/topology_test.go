package provisioner

import (
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testdriver"
)

// zoneKey is a second topology key the test's CSINodes register beside the driver's own.
const zoneKey = "topology.example.com/zone"

// createZonedNode creates a Node labelled with the driver's node key and a zone, and its
// CSINode registering both keys for the driver, as a node plugin with two keys would.
func (s *scenario) createZonedNode(suffix, zone string) string {
	s.T.Helper()
	name := s.name(suffix)
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{testdriver.TopologyKey: name, zoneKey: zone}}}
	if _, err := s.Client.CoreV1().Nodes().Create(s.ctx(), node, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	csiNode := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{
		{Name: s.driver, NodeID: name, TopologyKeys: []string{testdriver.TopologyKey, zoneKey}},
	}}}
	if _, err := s.Client.StorageV1().CSINodes().Create(s.ctx(), csiNode, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	return name
}

// Topology as upstream computes it, on the API server's objects:
//   - immediate binding while no CSINode carries the driver's topology keys is retried
//     with upstream's error, and no volume is made until a node registers;
//   - with two topology keys and allowedTopologies on one of them, a WaitForFirstConsumer
//     claim is provisioned in the zone of the selected node (the first allowed term the
//     node's topology contains), not refused as outside the requisite.
//
// The driver has a name of its own, so no other test's CSINodes count.
func TestTopologyWithTwoKeysAndWithoutRegisteredNodes(t *testing.T) {
	s := newScenario(t, testdriver.Config{DriverName: "topology.csi.sidecars.io", Topology: true})
	immediate := s.createClass("immediate", nil)
	late := s.createClass("late", func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
		sc.AllowedTopologies = []v1.TopologySelectorTerm{{MatchLabelExpressions: []v1.TopologySelectorLabelRequirement{
			{Key: zoneKey, Values: []string{"zone-a", "zone-b"}},
		}}}
	})
	r := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	r.WaitReady(t)

	early := s.createClaim("early", immediate.Name, "")
	s.WaitUntil("the claim told that no topology is available", func() bool {
		return slices.ContainsFunc(s.events("early", "ProvisioningFailed"), func(m string) bool { return strings.Contains(m, "no available topology found") })
	})
	if calls := createCalls(s.Driver.Journal()); len(calls) != 0 {
		t.Fatalf("CreateVolume calls before any node registered topology: %+v", calls)
	}
	s.createZonedNode("a", "zone-a")
	nodeB := s.createZonedNode("b", "zone-b")
	s.WaitUntil("the immediate claim's PersistentVolume", func() bool { return len(s.pvsByClaim()[early.UID]) == 1 })
	if affinity := s.pvsByClaim()[early.UID][0].Spec.NodeAffinity; affinity == nil {
		t.Error("the immediate claim's PersistentVolume has no node affinity")
	}

	claim := s.createClaim("late", late.Name, nodeB)
	s.WaitUntil("the delayed claim's PersistentVolume", func() bool { return len(s.pvsByClaim()[claim.UID]) == 1 })
	pv := s.pvsByClaim()[claim.UID][0]
	want := &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{
		{Key: zoneKey, Operator: v1.NodeSelectorOpIn, Values: []string{"zone-b"}},
	}}}}}
	if got := pv.Spec.NodeAffinity; got == nil || !slices.EqualFunc(got.Required.NodeSelectorTerms, want.Required.NodeSelectorTerms, func(a, b v1.NodeSelectorTerm) bool {
		return len(a.MatchExpressions) == 1 && a.MatchExpressions[0].Key == b.MatchExpressions[0].Key && slices.Equal(a.MatchExpressions[0].Values, b.MatchExpressions[0].Values)
	}) {
		t.Errorf("node affinity %+v, want zone-b of the selected node", got)
	}
	if failed := s.events("late", "ProvisioningFailed"); len(failed) > 0 {
		t.Errorf("ProvisioningFailed events for the delayed claim: %v", failed)
	}
}
