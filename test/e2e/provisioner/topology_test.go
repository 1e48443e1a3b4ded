package provisioner

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// zoneKey is a second topology key the test's CSINodes register beside the driver's own.
const zoneKey = "topology.example.com/zone"

// createZonedNode creates a Node labelled with the driver's node key and a zone, and its
// CSINode registering both keys for the driver, as a node plugin with two keys would.
func (s *scenario) createZonedNode(suffix, zone string) string {
	s.T.Helper()
	return s.createNodeWith(suffix, map[string]string{zoneKey: zone}, testdriver.TopologyKey, zoneKey)
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

// As upstream v6.4: an immediate claim's requisite topology covers every set of keys the
// driver registered, each from the nodes that registered that set, and a delayed claim's
// covers the nodes that registered the selected node's keys. A node that carries the
// labels but where the driver did not register them is never in it. (Up to v6.3 the keys
// of one CSINode were taken for the whole cluster, and every node with the labels counted.)
func TestRequisiteTopologyCoversEveryRegisteredKeySetAndOnlyRegisteringNodes(t *testing.T) {
	s := newScenario(t, testdriver.Config{DriverName: "keysets.csi.sidecars.io", Topology: true})
	immediate := s.createClass("immediate", nil)
	late := s.createClass("late", func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	})
	both := s.createZonedNode("both", "zone-a")
	nodeOnly := s.createNodeWith("node-only", map[string]string{zoneKey: "zone-b"}, testdriver.TopologyKey)
	s.createNodeWith("unregistered", map[string]string{zoneKey: "zone-c"})
	r := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	r.WaitReady(t)

	requisite := func(claim *v1.PersistentVolumeClaim) []string {
		t.Helper()
		s.WaitUntil("claim "+claim.Name+"'s PersistentVolume", func() bool { return len(s.pvsByClaim()[claim.UID]) == 1 })
		for _, c := range createCalls(s.Driver.Journal()) {
			if c.VolumeName == s.pvsByClaim()[claim.UID][0].Name && c.Code == "OK" {
				return slices.Sorted(slices.Values(c.RequisiteList()))
			}
		}
		t.Fatalf("no successful CreateVolume for claim %s", claim.Name)
		return nil
	}
	// Each key set over the nodes that registered all of its keys: the node key alone
	// over both nodes, the node key and the zone over the one that registered the zone.
	want := slices.Sorted(slices.Values([]string{
		fmt.Sprintf("%s=zone-a,%s=%s", zoneKey, testdriver.TopologyKey, both),
		fmt.Sprintf("%s=%s", testdriver.TopologyKey, both),
		fmt.Sprintf("%s=%s", testdriver.TopologyKey, nodeOnly),
	}))
	if got := requisite(s.createClaim("early", immediate.Name, "")); !slices.Equal(got, want) {
		t.Errorf("immediate binding: requisite %q, want %q", got, want)
	}
	want = []string{fmt.Sprintf("%s=zone-a,%s=%s", zoneKey, testdriver.TopologyKey, both)}
	if got := requisite(s.createClaim("late", late.Name, both)); !slices.Equal(got, want) {
		t.Errorf("delayed binding on %s: requisite %q, want %q", both, got, want)
	}
}
