package request

import (
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
)

const (
	zoneKey = "example.com/zone"
	rackKey = "example.com/rack"
	drv     = "drv.example.com"
)

func TestAccessibilityRequirements(t *testing.T) {
	n1 := objects.Node("n1", map[string]string{zoneKey: "z1"})
	n2 := objects.Node("n2", map[string]string{zoneKey: "z2"})
	n3 := objects.Node("n3", map[string]string{zoneKey: "z3"})
	nUnlabelled := objects.Node("n4", map[string]string{})
	twoKeys := objects.Node("n5", map[string]string{zoneKey: "z2", rackKey: "r1"})
	cluster := TopologyInput{
		Driver:    drv,
		ClaimName: "data",
		CSINodes:  []*storagev1.CSINode{objects.CSINode(drv, "n1", zoneKey), objects.CSINode(drv, "n2", zoneKey), objects.CSINode(drv, "n3", zoneKey)},
		Nodes:     []*v1.Node{n1, n2, n3, nUnlabelled},
		Immediate: true,
	}
	with := func(change func(*TopologyInput)) TopologyInput {
		in := cluster
		change(&in)
		return in
	}
	allowed := []v1.TopologySelectorTerm{{MatchLabelExpressions: []v1.TopologySelectorLabelRequirement{
		{Key: zoneKey, Values: []string{"z2", "z1"}},
	}}}
	for _, tc := range []struct {
		name    string
		in      TopologyInput
		want    *csi.TopologyRequirement
		wantErr string
	}{
		{
			name: "delayed binding: every zone, selected first",
			in:   with(func(in *TopologyInput) { in.SelectedNode, in.SelectedCSINode = n2, objects.CSINode(drv, "n2", zoneKey) }),
			want: &csi.TopologyRequirement{
				Requisite: []*csi.Topology{objects.Topology(zoneKey, "z1"), objects.Topology(zoneKey, "z2"), objects.Topology(zoneKey, "z3")},
				Preferred: []*csi.Topology{objects.Topology(zoneKey, "z2"), objects.Topology(zoneKey, "z3"), objects.Topology(zoneKey, "z1")},
			},
		},
		{
			name: "delayed binding, strict: only the selected node",
			in: with(func(in *TopologyInput) {
				in.SelectedNode, in.SelectedCSINode, in.Strict = n2, objects.CSINode(drv, "n2", zoneKey), true
			}),
			want: &csi.TopologyRequirement{Requisite: []*csi.Topology{objects.Topology(zoneKey, "z2")}, Preferred: []*csi.Topology{objects.Topology(zoneKey, "z2")}},
		},
		{
			name: "delayed binding, strict: selected node outside allowed topologies",
			in: with(func(in *TopologyInput) {
				in.SelectedNode, in.SelectedCSINode, in.Strict, in.Allowed = n3, objects.CSINode(drv, "n3", zoneKey), true, allowed
			}),
			wantErr: "is not in allowed topologies",
		},
		{
			name: "delayed binding with allowed topologies",
			in: with(func(in *TopologyInput) {
				in.SelectedNode, in.SelectedCSINode, in.Allowed = n2, objects.CSINode(drv, "n2", zoneKey), allowed
			}),
			want: &csi.TopologyRequirement{
				Requisite: []*csi.Topology{objects.Topology(zoneKey, "z1"), objects.Topology(zoneKey, "z2")},
				Preferred: []*csi.Topology{objects.Topology(zoneKey, "z2"), objects.Topology(zoneKey, "z1")},
			},
		},
		{
			name:    "selected node without the driver's keys",
			in:      with(func(in *TopologyInput) { in.SelectedNode, in.SelectedCSINode = n2, objects.CSINode(drv, "n2") }),
			wantErr: "no topology key found",
		},
		{
			name: "selected node without the topology label",
			in: with(func(in *TopologyInput) {
				in.SelectedNode, in.SelectedCSINode = nUnlabelled, objects.CSINode(drv, "n4", zoneKey)
			}),
			wantErr: "does not match topology keys",
		},
		{
			name: "immediate binding: aggregated, preferred rotated by the claim name hash",
			in:   cluster,
			want: func() *csi.TopologyRequirement {
				h, i := claimNameHash("data")
				req := []*csi.Topology{objects.Topology(zoneKey, "z1"), objects.Topology(zoneKey, "z2"), objects.Topology(zoneKey, "z3")}
				s := int((h + i) % 3)
				return &csi.TopologyRequirement{Requisite: req, Preferred: append(append([]*csi.Topology{}, req[s:]...), req[:s]...)}
			}(),
		},
		{
			name: "immediate binding without --immediate-topology: no requirement",
			in:   with(func(in *TopologyInput) { in.Immediate = false }),
			want: nil,
		},
		{
			name: "immediate binding, allowed topologies even without --immediate-topology",
			in:   with(func(in *TopologyInput) { in.Immediate, in.Allowed, in.ClaimName = false, allowed, "" }),
			want: func() *csi.TopologyRequirement {
				h, i := claimNameHash("")
				req := []*csi.Topology{objects.Topology(zoneKey, "z1"), objects.Topology(zoneKey, "z2")}
				s := int((h + i) % 2)
				return &csi.TopologyRequirement{Requisite: req, Preferred: append(append([]*csi.Topology{}, req[s:]...), req[:s]...)}
			}(),
		},
		{
			// Upstream's error, retried: a volume without a requirement could land where
			// no node of the driver is.
			name:    "immediate binding, no node registered topology yet: retried",
			in:      with(func(in *TopologyInput) { in.CSINodes = []*storagev1.CSINode{objects.CSINode(drv, "n1")} }),
			wantErr: "no available topology found",
		},
		{
			name: "delayed binding, two keys, allowed topologies on one: the term the node satisfies first",
			in: with(func(in *TopologyInput) {
				in.SelectedNode, in.SelectedCSINode, in.Allowed = twoKeys, objects.CSINode(drv, "n5", zoneKey, rackKey), allowed
				in.Nodes = []*v1.Node{twoKeys}
			}),
			want: &csi.TopologyRequirement{
				Requisite: []*csi.Topology{objects.Topology(zoneKey, "z1"), objects.Topology(zoneKey, "z2")},
				Preferred: []*csi.Topology{objects.Topology(zoneKey, "z2"), objects.Topology(zoneKey, "z1")},
			},
		},
		{
			name: "delayed binding, the node satisfies terms of two lengths: the shorter first, as upstream sorts",
			in: with(func(in *TopologyInput) {
				in.SelectedNode, in.SelectedCSINode, in.Nodes = twoKeys, objects.CSINode(drv, "n5", zoneKey, rackKey), []*v1.Node{twoKeys}
				in.Allowed = []v1.TopologySelectorTerm{
					{MatchLabelExpressions: []v1.TopologySelectorLabelRequirement{{Key: zoneKey, Values: []string{"z2"}}, {Key: rackKey, Values: []string{"r1"}}}},
					{MatchLabelExpressions: []v1.TopologySelectorLabelRequirement{{Key: zoneKey, Values: []string{"z3", "z2"}}}},
				}
			}),
			want: &csi.TopologyRequirement{
				Requisite: []*csi.Topology{objects.Topology(zoneKey, "z2"), objects.Topology(zoneKey, "z3"), objects.Topology(zoneKey, "z2", rackKey, "r1")},
				Preferred: []*csi.Topology{objects.Topology(zoneKey, "z2"), objects.Topology(zoneKey, "z3"), objects.Topology(zoneKey, "z2", rackKey, "r1")},
			},
		},
		{
			name: "delayed binding, allowed topologies the node does not satisfy",
			in: with(func(in *TopologyInput) {
				in.SelectedNode, in.SelectedCSINode, in.Allowed = n3, objects.CSINode(drv, "n3", zoneKey), allowed
			}),
			wantErr: "is not in requisite",
		},
		{
			// Upstream v6.4: every key set the driver registered, each aggregated over the
			// nodes that registered it; a node with the labels but without the driver's
			// registration (n6) is left out.
			name: "immediate binding, nodes registered different key sets: each set, from its own nodes",
			in: with(func(in *TopologyInput) {
				in.CSINodes = []*storagev1.CSINode{objects.CSINode(drv, "n1", zoneKey), objects.CSINode(drv, "n2", zoneKey), objects.CSINode(drv, "n5", rackKey, zoneKey), objects.CSINode(drv, "n6")}
				in.Nodes = []*v1.Node{n1, n2, twoKeys, objects.Node("n6", map[string]string{zoneKey: "z9", rackKey: "r9"})}
			}),
			want: func() *csi.TopologyRequirement {
				h, i := claimNameHash("data")
				req := []*csi.Topology{objects.Topology(zoneKey, "z1"), objects.Topology(zoneKey, "z2"), objects.Topology(zoneKey, "z2", rackKey, "r1")}
				s := int((h + i) % 3)
				return &csi.TopologyRequirement{Requisite: req, Preferred: append(append([]*csi.Topology{}, req[s:]...), req[:s]...)}
			}(),
		},
		{
			name: "delayed binding: a node whose driver did not register the keys is left out, labels or not",
			in: with(func(in *TopologyInput) {
				in.SelectedNode, in.SelectedCSINode = n2, objects.CSINode(drv, "n2", zoneKey)
				in.CSINodes = []*storagev1.CSINode{objects.CSINode(drv, "n1", zoneKey), objects.CSINode(drv, "n2", zoneKey), objects.CSINode(drv, "n3")}
			}),
			want: &csi.TopologyRequirement{
				Requisite: []*csi.Topology{objects.Topology(zoneKey, "z1"), objects.Topology(zoneKey, "z2")},
				Preferred: []*csi.Topology{objects.Topology(zoneKey, "z2"), objects.Topology(zoneKey, "z1")},
			},
		},
		{
			name:    "keys registered but no node carries them",
			in:      with(func(in *TopologyInput) { in.Nodes = []*v1.Node{nUnlabelled} }),
			wantErr: "were not found on any nodes",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := AccessibilityRequirements(tc.in)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got, protocmp.Transform()); diff != "" {
				t.Errorf("requirement (-want +got):\n%s", diff)
			}
		})
	}
}

func TestFlattenDistributesValuesOverKeys(t *testing.T) {
	got := sortedUnique(flatten([]v1.TopologySelectorTerm{
		{MatchLabelExpressions: []v1.TopologySelectorLabelRequirement{
			{Key: zoneKey, Values: []string{"z1", "z2"}},
			{Key: rackKey, Values: []string{"r1", "r2"}},
		}},
		{MatchLabelExpressions: []v1.TopologySelectorLabelRequirement{{Key: zoneKey, Values: []string{"z1"}}}},
		{MatchLabelExpressions: []v1.TopologySelectorLabelRequirement{{Key: zoneKey, Values: []string{"z1"}}}},
	}))
	// Sorted as upstream sorts: fewer pairs first, then pair by pair.
	want := []Term{
		{zoneKey: "z1"},
		{rackKey: "r1", zoneKey: "z1"}, {rackKey: "r1", zoneKey: "z2"},
		{rackKey: "r2", zoneKey: "z1"}, {rackKey: "r2", zoneKey: "z2"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("terms (-want +got):\n%s", diff)
	}
}

func TestClaimNameHashKeepsAStatefulSetPodsClaimsTogetherAndSpreadsOrdinals(t *testing.T) {
	hData0, i0 := claimNameHash("data-web-0")
	hLogs0, _ := claimNameHash("logs-web-0")
	hData1, i1 := claimNameHash("data-web-1")
	if hData0 != hLogs0 || hData0 != hData1 {
		t.Errorf("claims of one StatefulSet hash differently: %d %d %d", hData0, hLogs0, hData1)
	}
	if i0 != 0 || i1 != 1 {
		t.Errorf("ordinals %d %d, want 0 1", i0, i1)
	}
	if h, i := claimNameHash("plain"); i != 0 || h == hData0 {
		t.Errorf("plain name: hash %d index %d", h, i)
	}
}

func TestNodeAffinityHasOneTermPerAccessibleSegment(t *testing.T) {
	got := NodeAffinity([]*csi.Topology{objects.Topology(zoneKey, "z1", rackKey, "r1"), objects.Topology(), objects.Topology(zoneKey, "z2")})
	want := &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{
		{MatchExpressions: []v1.NodeSelectorRequirement{
			{Key: rackKey, Operator: v1.NodeSelectorOpIn, Values: []string{"r1"}},
			{Key: zoneKey, Operator: v1.NodeSelectorOpIn, Values: []string{"z1"}},
		}},
		{MatchExpressions: []v1.NodeSelectorRequirement{{Key: zoneKey, Operator: v1.NodeSelectorOpIn, Values: []string{"z2"}}}},
	}}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("affinity (-want +got):\n%s", diff)
	}
	if NodeAffinity(nil) != nil {
		t.Error("no topology must give no affinity")
	}
}
