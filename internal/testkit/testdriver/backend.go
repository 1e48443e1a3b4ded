package testdriver

import (
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
)

// Backend is the in-memory storage system behind one driver. Every server
// started with Serve shares it, so sidecar replicas on different sockets see
// the same volumes, journal and faults. All methods are safe for concurrent
// use.
type Backend struct {
	// cfg is fixed after New; what may change at run time is copied into
	// the fields below.
	cfg Config

	mu            sync.Mutex
	volumes       map[string]*Volume // by id
	lastID        int
	latency       time.Duration
	methodLatency map[string]time.Duration
	// holds has a channel per held method (Hold), closed by its release.
	holds    map[string]chan struct{}
	faults   []Fault
	calls    []Call
	overlaps []overlapRef
	// running maps an overlap key (volume id or "name:"+name) to the journal
	// indices of the mutating operations on it still running in the backend.
	running map[string][]int
	// runningKeys holds the keys each running operation is listed under.
	runningKeys map[int][]string
	// changed is closed and replaced on every journal change, waking
	// WaitFor.
	changed chan struct{}
	// nodeExpansion overrides Config.NodeExpansionRequired per volume id.
	nodeExpansion map[string]bool
	// notReady makes Probe answer ready=false (SetProbeReady).
	notReady bool
	// snapshots by id, and the last id handed out.
	snapshots      map[string]*Snapshot
	lastSnapshotID int
	// groupSnapshots by id, and the last id handed out.
	groupSnapshots map[string]*GroupSnapshot
	lastGroupID    int
	// capacityRules are what GetCapacity answers from.
	capacityRules []CapacityRule
	// health holds the adverse conditions of each abnormal volume, by id (SetVolumeHealth);
	// a volume without an entry is healthy.
	health map[string][]HealthCondition
}

// Volume is the backend's record of one volume. Values returned by Backend
// methods are copies.
type Volume struct {
	ID                string
	Name              string
	CapacityBytes     int64
	Parameters        map[string]string
	MutableParameters map[string]string
	VolumeContext     map[string]string
	// ContentSource is the snapshot or volume this one was created from.
	ContentSource      *csi.VolumeContentSource
	AccessibleTopology []*csi.Topology
	// Published maps each node the volume is published to onto the readonly
	// flag it was published with.
	Published map[string]bool
}

// New returns an empty backend for cfg.
func New(cfg Config) (*Backend, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("invalid test driver config: %w", err)
	}
	return &Backend{
		cfg:            cfg,
		volumes:        map[string]*Volume{},
		latency:        cfg.Latency,
		methodLatency:  maps.Clone(cfg.MethodLatency),
		holds:          map[string]chan struct{}{},
		running:        map[string][]int{},
		runningKeys:    map[int][]string{},
		changed:        make(chan struct{}),
		nodeExpansion:  map[string]bool{},
		snapshots:      map[string]*Snapshot{},
		groupSnapshots: map[string]*GroupSnapshot{},
		capacityRules:  cloneRules(cfg.CapacityRules),
		health:         map[string][]HealthCondition{},
	}, nil
}

// DriverName is the name GetPluginInfo reports.
func (b *Backend) DriverName() string { return b.cfg.DriverName }

// NodeID is the node id NodeGetInfo reports.
func (b *Backend) NodeID() string { return b.cfg.NodeID }

// Volumes returns a copy of every volume, sorted by id.
func (b *Backend) Volumes() []Volume {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]Volume, 0, len(b.volumes))
	for _, id := range b.sortedIDsLocked() {
		out = append(out, b.volumes[id].clone())
	}
	return out
}

// Volume returns a copy of the volume with the given id.
func (b *Backend) Volume(id string) (Volume, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	v, ok := b.volumes[id]
	if !ok {
		return Volume{}, false
	}
	return v.clone(), true
}

// sortedIDsLocked returns the volume ids in the order ListVolumes pages
// through them. Ids are zero padded so that this is also creation order.
func (b *Backend) sortedIDsLocked() []string {
	return slices.Sorted(maps.Keys(b.volumes))
}

// volumeByNameLocked finds a volume by the name it was created with.
func (b *Backend) volumeByNameLocked(name string) *Volume {
	for _, v := range b.volumes {
		if v.Name == name {
			return v
		}
	}
	return nil
}

// newIDLocked returns a fresh volume id. The fixed width keeps string order
// equal to creation order, which ListVolumes tokens rely on.
func (b *Backend) newIDLocked() string {
	b.lastID++
	return fmt.Sprintf("%s%0*d", volumeIDPrefix, volumeIDDigits, b.lastID)
}

// Volume ids are volumeIDPrefix followed by volumeIDDigits digits.
const (
	volumeIDPrefix = "vol-"
	volumeIDDigits = 8
)

// usedCapacityLocked is the sum of all volume sizes.
func (b *Backend) usedCapacityLocked() int64 {
	var used int64
	for _, v := range b.volumes {
		used += v.CapacityBytes
	}
	return used
}

// nodeExists reports whether ControllerPublishVolume may target node.
func (b *Backend) nodeExists(node string) bool {
	return b.cfg.Nodes == nil || slices.Contains(b.cfg.Nodes, node)
}

// hasCapability reports whether a controller capability is advertised.
func (b *Backend) hasCapability(c csi.ControllerServiceCapability_RPC_Type) bool {
	return !b.cfg.DisableControllerService && slices.Contains(b.cfg.ControllerCapabilities, c)
}

// groupControllerEnabled reports whether the GroupController service is
// advertised and served: with snapshots, unless switched off.
func (b *Backend) groupControllerEnabled() bool {
	return !b.cfg.DisableGroupController && b.hasCapability(csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT)
}

// clone returns a deep copy, so that callers can never reach backend state
// without the lock.
func (v *Volume) clone() Volume {
	c := *v
	c.Parameters = maps.Clone(v.Parameters)
	c.MutableParameters = maps.Clone(v.MutableParameters)
	c.VolumeContext = maps.Clone(v.VolumeContext)
	c.Published = maps.Clone(v.Published)
	if v.ContentSource != nil {
		c.ContentSource = proto.Clone(v.ContentSource).(*csi.VolumeContentSource)
	}
	c.AccessibleTopology = make([]*csi.Topology, 0, len(v.AccessibleTopology))
	for _, t := range v.AccessibleTopology {
		c.AccessibleTopology = append(c.AccessibleTopology, proto.Clone(t).(*csi.Topology))
	}
	return c
}

// toCSI converts the record to the CSI message returned by the Controller.
func (v *Volume) toCSI() *csi.Volume {
	c := v.clone()
	return &csi.Volume{
		VolumeId:           c.ID,
		CapacityBytes:      c.CapacityBytes,
		VolumeContext:      c.VolumeContext,
		ContentSource:      c.ContentSource,
		AccessibleTopology: c.AccessibleTopology,
	}
}

// SetNodeExpansionRequired decides, for one volume id, whether
// ControllerExpandVolume answers node_expansion_required, overriding
// Config.NodeExpansionRequired. It affects operations that end afterwards.
func (b *Backend) SetNodeExpansionRequired(volumeID string, required bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.nodeExpansion[volumeID] = required
}

// SetProbeReady decides what Probe answers in its ready field: true (the
// default), or false, as a driver that is up but cannot serve yet. The call
// itself still succeeds; a failing Probe is a Fault. It affects operations that
// end afterwards.
func (b *Backend) SetProbeReady(ready bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.notReady = !ready
}

// nodeExpansionRequiredLocked is what ControllerExpandVolume answers for a
// volume. The caller holds b.mu.
func (b *Backend) nodeExpansionRequiredLocked(volumeID string) bool {
	if required, ok := b.nodeExpansion[volumeID]; ok {
		return required
	}
	return b.cfg.NodeExpansionRequired
}
