package testdriver

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// Defaults used when the matching Config field is left empty.
const (
	DefaultDriverName    = "test.csi.sidecars.io"
	DefaultVendorVersion = "dev"
	DefaultNodeID        = "test-node"
	// DefaultVolumeSize is the size of a volume whose request has no capacity
	// range.
	DefaultVolumeSize int64 = 1 << 30
	// DefaultTotalCapacity is the pool size when Config.TotalCapacity is 0:
	// 1 PiB, large enough that tests never run out by accident.
	DefaultTotalCapacity int64 = 1 << 50
	// TopologyKey is the only topology segment key the driver knows. A node's
	// segment value is its node id.
	TopologyKey = "topology.test.csi.sidecars.io/node"
)

// DefaultMutableParameters returns the keys ControllerModifyVolume and
// CreateVolume accept in mutable_parameters when Config.MutableParameters is
// nil.
func DefaultMutableParameters() []string {
	return []string{"iops", "throughput"}
}

// Config describes one driver instance. The zero value is usable: every empty
// field takes the default documented on it.
type Config struct {
	// DriverName is returned by GetPluginInfo; default DefaultDriverName.
	DriverName string
	// VendorVersion is returned by GetPluginInfo; default DefaultVendorVersion.
	VendorVersion string

	// DisableControllerService stops advertising CONTROLLER_SERVICE; every
	// Controller RPC then returns Unimplemented, as for a node-only driver.
	DisableControllerService bool
	// ControllerCapabilities are the advertised controller capabilities. nil
	// means DefaultControllerCapabilities(); an empty non-nil slice means
	// none. An RPC whose capability is not advertised returns Unimplemented.
	ControllerCapabilities []csi.ControllerServiceCapability_RPC_Type
	// Topology advertises VOLUME_ACCESSIBILITY_CONSTRAINTS and makes
	// NodeGetInfo report a TopologyKey segment.
	Topology bool
	// DisableGroupController stops serving group snapshots. Otherwise the
	// GroupController service (CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT) is
	// advertised and served whenever the Controller service advertises
	// CREATE_DELETE_SNAPSHOT; without it every GroupController RPC returns
	// Unimplemented.
	DisableGroupController bool

	// NodeID is what NodeGetInfo reports; default DefaultNodeID.
	NodeID string
	// Nodes lists the node ids ControllerPublishVolume accepts (plus NodeID).
	// nil means every node id exists, which suits tests that invent node
	// names; a non-nil list makes publishing to any other node NotFound.
	Nodes []string
	// MaxVolumesPerNode limits publications per node (ResourceExhausted
	// beyond it) and is reported by NodeGetInfo; 0 means no limit.
	MaxVolumesPerNode int64

	// TotalCapacity is the size of the storage pool GetCapacity reports from
	// and CreateVolume allocates from; default DefaultTotalCapacity.
	TotalCapacity int64
	// CapacityRules are GetCapacity's answers per topology segment and
	// parameters (see CapacityRule); SetCapacityRules changes them at run
	// time. With no matching rule GetCapacity reports the pool's free space.
	CapacityRules []CapacityRule
	// MutableParameters are the keys accepted in mutable_parameters; nil
	// means DefaultMutableParameters().
	MutableParameters []string

	// SnapshotReadyAfter keeps every snapshot, and so every group snapshot,
	// reported with ready_to_use false until this long after it was cut, as
	// a backend that uploads snapshots after cutting them. 0 (the default)
	// means ready at once.
	SnapshotReadyAfter time.Duration
	// SnapshotReadyAfterPolls keeps every snapshot reported with
	// ready_to_use false in the first SnapshotReadyAfterPolls answers that
	// describe it: the CreateSnapshot (or CreateVolumeGroupSnapshot) that
	// cut it, and then each status poll (a repeated CreateSnapshot or
	// CreateVolumeGroupSnapshot, a ListSnapshots or GetSnapshot entry, a
	// GetVolumeGroupSnapshot). With SnapshotReadyAfter also set, a snapshot
	// turns ready once both have passed. 0 (the default) means ready at
	// once. Backend.MarkSnapshotReady makes a snapshot ready at any time.
	SnapshotReadyAfterPolls int

	// NodeExpansionRequired makes ControllerExpandVolume answer
	// node_expansion_required, as a driver does for a volume whose file
	// system must still be grown on the node. SetNodeExpansionRequired
	// overrides it per volume.
	NodeExpansionRequired bool
	// NodeExpansion advertises the Node service's EXPAND_VOLUME capability
	// in NodeGetCapabilities, as a driver that grows volumes only on the
	// node does.
	NodeExpansion bool

	// Latency is how long each backend operation of a Controller or
	// GroupController RPC that reaches the storage (all but the capability
	// RPCs) takes unless MethodLatency overrides it. Identity, capability and
	// Node RPCs only get a latency from MethodLatency, so that a slow "cloud"
	// does not also slow down sidecar start-up probing.
	Latency time.Duration
	// MethodLatency overrides Latency per method name (see the Method
	// constants).
	MethodLatency map[string]time.Duration

	// HealthPageSize caps each ControllerListVolumeHealth page at this many entries even
	// when the request asks for more or sets no max_entries, as a driver that pages on its
	// own does (a next_token follows); 0 means no cap.
	HealthPageSize int

	// JournalWriter, when set, receives each finished call as one JSON line,
	// so that another process can follow the journal.
	JournalWriter io.Writer
}

// DefaultControllerCapabilities returns the capabilities advertised when
// Config.ControllerCapabilities is nil.
func DefaultControllerCapabilities() []csi.ControllerServiceCapability_RPC_Type {
	return []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
		csi.ControllerServiceCapability_RPC_PUBLISH_READONLY,
		csi.ControllerServiceCapability_RPC_MODIFY_VOLUME,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
	}
}

// ImplementedControllerCapabilities lists every controller capability whose RPCs the
// driver implements; advertising any other would promise RPCs that answer Unimplemented.
// The volume health capabilities are implemented but not among the defaults, as most
// drivers do not report health. Group snapshots are no controller capability but the GroupController
// service (see Config.DisableGroupController).
func ImplementedControllerCapabilities() []csi.ControllerServiceCapability_RPC_Type {
	return []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_READONLY,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
		csi.ControllerServiceCapability_RPC_GET_VOLUME,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.ControllerServiceCapability_RPC_MODIFY_VOLUME,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH,
	}
}

func isImplementedCapability(c csi.ControllerServiceCapability_RPC_Type) bool {
	return slices.Contains(ImplementedControllerCapabilities(), c)
}

// ParseControllerCapabilities parses a comma separated list of controller
// capability names as spelled in the CSI spec (e.g.
// "CREATE_DELETE_VOLUME,PUBLISH_UNPUBLISH_VOLUME"), case-insensitively. An
// empty string yields an empty, non-nil list.
func ParseControllerCapabilities(list string) ([]csi.ControllerServiceCapability_RPC_Type, error) {
	caps := []csi.ControllerServiceCapability_RPC_Type{}
	for _, name := range strings.Split(list, ",") {
		name = strings.ToUpper(strings.TrimSpace(name))
		if name == "" {
			continue
		}
		v, ok := csi.ControllerServiceCapability_RPC_Type_value[name]
		if !ok {
			return nil, fmt.Errorf("unknown controller capability %q", name)
		}
		c := csi.ControllerServiceCapability_RPC_Type(v)
		if !slices.Contains(caps, c) {
			caps = append(caps, c)
		}
	}
	return caps, nil
}

// withDefaults returns a copy of c with defaults filled in, or an error when
// c asks for something the driver cannot do.
func (c Config) withDefaults() (Config, error) {
	if c.DriverName == "" {
		c.DriverName = DefaultDriverName
	}
	if c.VendorVersion == "" {
		c.VendorVersion = DefaultVendorVersion
	}
	if c.NodeID == "" {
		c.NodeID = DefaultNodeID
	}
	if c.TotalCapacity == 0 {
		c.TotalCapacity = DefaultTotalCapacity
	}
	if c.TotalCapacity < 0 || c.MaxVolumesPerNode < 0 || c.Latency < 0 || c.HealthPageSize < 0 {
		return c, fmt.Errorf("negative TotalCapacity, MaxVolumesPerNode, Latency or HealthPageSize in config")
	}
	if c.SnapshotReadyAfter < 0 || c.SnapshotReadyAfterPolls < 0 {
		return c, fmt.Errorf("negative SnapshotReadyAfter or SnapshotReadyAfterPolls in config")
	}
	if c.ControllerCapabilities == nil {
		c.ControllerCapabilities = DefaultControllerCapabilities()
	}
	for _, cp := range c.ControllerCapabilities {
		if !isImplementedCapability(cp) {
			return c, fmt.Errorf("controller capability %s is not implemented by the test driver", cp)
		}
	}
	if slices.Contains(c.ControllerCapabilities, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH) &&
		!slices.Contains(c.ControllerCapabilities, csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH) {
		// The spec: a plugin with LIST_VOLUME_HEALTH MUST also support GET_VOLUME_HEALTH.
		return c, fmt.Errorf("controller capability LIST_VOLUME_HEALTH needs GET_VOLUME_HEALTH")
	}
	c.ControllerCapabilities = slices.Clone(c.ControllerCapabilities)
	if c.MutableParameters == nil {
		c.MutableParameters = DefaultMutableParameters()
	}
	c.MutableParameters = slices.Clone(c.MutableParameters)
	if c.Nodes != nil {
		c.Nodes = append(slices.Clone(c.Nodes), c.NodeID)
	}
	latencies := make(map[string]time.Duration, len(c.MethodLatency))
	for m, d := range c.MethodLatency {
		if d < 0 {
			return c, fmt.Errorf("negative latency %v for method %s", d, m)
		}
		latencies[m] = d
	}
	c.MethodLatency = latencies
	return c, nil
}
