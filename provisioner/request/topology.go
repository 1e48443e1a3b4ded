package request

import (
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
)

// Term is one topology segment: key/value pairs that hold together (AND).
type Term map[string]string

// ID is a canonical form of a term: "k1#v1,k2#v2" with keys sorted. It finds duplicates
// and, among terms of one length, orders them.
func (t Term) ID() string {
	parts := make([]string, 0, len(t))
	for k, v := range t {
		parts = append(parts, k+"#"+v)
	}
	slices.Sort(parts)
	return strings.Join(parts, ",")
}

// compare orders terms as upstream does: fewer pairs first, then pair by pair (key, then
// value), which the id's order is for the characters label keys and values may hold. The
// order decides which term the selected node's preference starts at.
func (t Term) compare(other Term) int {
	if len(t) != len(other) {
		return len(t) - len(other)
	}
	return strings.Compare(t.ID(), other.ID())
}

// containedIn tells whether every pair of t is also in other.
func (t Term) containedIn(other Term) bool {
	for k, v := range t {
		if other[k] != v {
			return false
		}
	}
	return true
}

// TopologyInput is what the accessibility requirement of a new volume depends on, read
// from the listers by the caller.
type TopologyInput struct {
	Driver    string
	ClaimName string
	// Allowed are the StorageClass's allowedTopologies.
	Allowed []v1.TopologySelectorTerm
	// SelectedNode and selectedCSINode are set for delayed binding (the scheduler's
	// choice); both nil for immediate binding.
	SelectedNode    *v1.Node
	SelectedCSINode *storagev1.CSINode
	// CSINodes and nodes are the cluster's, to aggregate topologies from.
	CSINodes []*storagev1.CSINode
	Nodes    []*v1.Node
	// Strict passes only the selected node's topology; immediate passes the aggregated
	// topology of the cluster for immediate binding (else no requirement).
	Strict, Immediate bool
}

// AccessibilityRequirements computes the TopologyRequirement of CreateVolume as upstream:
// requisite from allowedTopologies, else aggregated from the nodes where the driver
// registered its topology keys (aggregate; only the selected node with strict topology); preferred is the
// requisite list starting at the first term the selected node's segment satisfies (a
// subset of it: allowedTopologies may name fewer keys than the node has), or, with no node
// selected, shifted by a hash of the claim name so that a StatefulSet's volumes spread.
// nil means no requirement. With nothing to aggregate from (no node has registered the
// driver's topology keys yet) it is an error to retry, as upstream: a volume made without
// a requirement could land where no node of the driver is.
func AccessibilityRequirements(in TopologyInput) (*csi.TopologyRequirement, error) {
	var selected Term
	var requisite []Term
	if in.SelectedNode != nil {
		keys := topologyKeys(in.SelectedCSINode, in.Driver)
		if len(keys) == 0 {
			// The driver has not registered on that node (yet): the scheduler should try
			// again, perhaps elsewhere.
			return nil, fmt.Errorf("no topology key found on CSINode %s", in.SelectedNode.Name)
		}
		var ok bool
		if selected, ok = nodeTerm(in.SelectedNode, keys); !ok {
			return nil, fmt.Errorf("topology labels from selected node %v does not match topology keys from CSINode %v", in.SelectedNode.Labels, keys)
		}
		if in.Strict {
			if len(in.Allowed) > 0 && !slices.ContainsFunc(flatten(in.Allowed), func(t Term) bool { return t.containedIn(selected) }) {
				return nil, fmt.Errorf("selected node %q topology %v is not in allowed topologies: %v", in.SelectedNode.Name, selected, flatten(in.Allowed))
			}
			requisite = []Term{selected}
		}
	}
	if len(requisite) == 0 {
		switch {
		case len(in.Allowed) > 0:
			requisite = flatten(in.Allowed)
		case in.SelectedNode == nil && !in.Immediate:
			return nil, nil
		default:
			var err error
			if requisite, err = aggregate(in); err != nil {
				return nil, err
			}
			if len(requisite) == 0 {
				return nil, errors.New("no available topology found")
			}
		}
	}
	if len(requisite) == 0 {
		return nil, nil
	}
	requisite = sortedUnique(requisite)

	var preferred []Term
	switch {
	case in.SelectedNode == nil:
		hash, index := claimNameHash(in.ClaimName)
		preferred = rotate(requisite, int((hash+index)%uint32(len(requisite))))
	case in.Strict:
		preferred = requisite
	default:
		i := slices.IndexFunc(requisite, func(t Term) bool { return t.containedIn(selected) })
		if i < 0 {
			return nil, fmt.Errorf("topology %v from selected node %q is not in requisite: %v", selected, in.SelectedNode.Name, requisite)
		}
		preferred = rotate(requisite, i)
	}
	return &csi.TopologyRequirement{Requisite: toCSI(requisite), Preferred: toCSI(preferred)}, nil
}

// aggregate collects the segments of the cluster's nodes, as upstream v6.4: with a node
// selected, of every node whose CSINode registered all of that node's topology keys for
// the driver; with none (immediate binding), of every set of keys the driver registered
// on some node, each from the nodes whose CSINode registered that set. A node's labels
// alone never count: a node where the driver did not register the keys is left out.
func aggregate(in TopologyInput) ([]Term, error) {
	registered := map[string][]string{}
	for _, n := range in.CSINodes {
		if keys := topologyKeys(n, in.Driver); len(keys) > 0 {
			registered[n.Name] = keys
		}
	}
	var keySets [][]string
	if in.SelectedNode != nil {
		keySets = [][]string{topologyKeys(in.SelectedCSINode, in.Driver)}
	} else {
		for _, keys := range registered {
			keys = slices.Sorted(slices.Values(keys))
			if !slices.ContainsFunc(keySets, func(k []string) bool { return slices.Equal(k, keys) }) {
				keySets = append(keySets, keys)
			}
		}
		if len(keySets) == 0 {
			// No node reported topology for the driver (yet): the caller waits for one.
			return nil, nil
		}
		slices.SortFunc(keySets, slices.Compare)
	}
	var terms []Term
	for _, keys := range keySets {
		for _, n := range in.Nodes {
			if !registersAll(registered[n.Name], keys) {
				continue
			}
			if t, ok := nodeTerm(n, keys); ok {
				terms = append(terms, t)
			}
		}
	}
	if len(terms) == 0 {
		if len(keySets) == 1 {
			return nil, fmt.Errorf("topologyKeys %v were not found on any nodes", keySets[0])
		}
		return nil, fmt.Errorf("topologyKeys %v were not found on any nodes", keySets)
	}
	return terms, nil
}

// registersAll tells whether registered holds every one of keys.
func registersAll(registered, keys []string) bool {
	for _, k := range keys {
		if !slices.Contains(registered, k) {
			return false
		}
	}
	return true
}

// topologyKeys are the keys the driver registered on a node.
func topologyKeys(n *storagev1.CSINode, driver string) []string {
	if n == nil {
		return nil
	}
	for _, d := range n.Spec.Drivers {
		if d.Name == driver {
			return d.TopologyKeys
		}
	}
	return nil
}

// nodeTerm is the node's segment for keys; false if a label is missing.
func nodeTerm(n *v1.Node, keys []string) (Term, bool) {
	t := Term{}
	for _, k := range keys {
		v, ok := n.Labels[k]
		if !ok {
			return nil, false
		}
		t[k] = v
	}
	return t, true
}

// flatten turns allowedTopologies (an OR of terms, each an AND of keys, each an OR of
// values) into an OR of segments by distributing the value ORs: {zone: [a, b], rack: [1]}
// becomes {zone: a, rack: 1} OR {zone: b, rack: 1}.
func flatten(allowed []v1.TopologySelectorTerm) []Term {
	var out []Term
	for _, st := range allowed {
		terms := []Term{{}}
		for _, expr := range st.MatchLabelExpressions {
			var next []Term
			for _, t := range terms {
				for _, v := range expr.Values {
					n := maps.Clone(t)
					n[expr.Key] = v
					next = append(next, n)
				}
			}
			terms = next
		}
		for _, t := range terms {
			if len(t) > 0 {
				out = append(out, t)
			}
		}
	}
	return out
}

// sortedUnique sorts terms (compare) and removes duplicates.
func sortedUnique(terms []Term) []Term {
	out := slices.Clone(terms)
	slices.SortFunc(out, Term.compare)
	return slices.CompactFunc(out, func(a, b Term) bool { return a.ID() == b.ID() })
}

// rotate returns terms starting at index i, wrapping around.
func rotate(terms []Term, i int) []Term {
	return append(slices.Clone(terms[i:]), terms[:i]...)
}

func toCSI(terms []Term) []*csi.Topology {
	out := make([]*csi.Topology, 0, len(terms))
	for _, t := range terms {
		out = append(out, &csi.Topology{Segments: maps.Clone(t)})
	}
	return out
}

// claimNameHash spreads the volumes of a StatefulSet over the requisite segments as the
// in-tree provisioners do: claims named <claim>-<set>-<ordinal> hash only <set> and are
// offset by the ordinal, so one pod's claims land together and the ordinals round-robin.
func claimNameHash(name string) (hash, index uint32) {
	base := name
	if dash := strings.LastIndexByte(name, '-'); dash >= 0 {
		if ordinal, err := strconv.ParseUint(name[dash+1:], 10, 32); err == nil {
			index = uint32(ordinal)
			base = name[:dash]
			if dash := strings.LastIndexByte(base, '-'); dash >= 0 {
				base = base[dash+1:]
			}
		}
	}
	h := fnv.New32()
	h.Write([]byte(base))
	return h.Sum32(), index
}

// NodeAffinity makes the PersistentVolume's node affinity from the topology CreateVolume
// returned: one term per segment, nil for none.
func NodeAffinity(accessible []*csi.Topology) *v1.VolumeNodeAffinity {
	var terms []v1.NodeSelectorTerm
	for _, t := range accessible {
		if len(t.GetSegments()) == 0 {
			continue
		}
		var exprs []v1.NodeSelectorRequirement
		for _, k := range slices.Sorted(maps.Keys(t.GetSegments())) {
			exprs = append(exprs, v1.NodeSelectorRequirement{Key: k, Operator: v1.NodeSelectorOpIn, Values: []string{t.GetSegments()[k]}})
		}
		terms = append(terms, v1.NodeSelectorTerm{MatchExpressions: exprs})
	}
	if len(terms) == 0 {
		return nil
	}
	return &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: terms}}
}
