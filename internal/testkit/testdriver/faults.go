package testdriver

import (
	"fmt"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Fault makes matching calls fail with a chosen gRPC code. The call still
// takes its latency, as a cloud API that fails after thinking about it.
type Fault struct {
	// Method is the RPC to fail (see the Method constants); required.
	Method string
	// Volume restricts the fault to one volume id, or, for CreateVolume, to
	// one requested name. CreateSnapshot matches its source volume,
	// CreateVolumeGroupSnapshot each of its source volumes. Empty matches
	// every volume.
	Volume string
	// Snapshot restricts the fault to calls about one snapshot or group
	// snapshot: its id (DeleteSnapshot, GetSnapshot, ListSnapshots by id,
	// Delete- and GetVolumeGroupSnapshot) or the name requested by
	// CreateSnapshot or CreateVolumeGroupSnapshot. Empty matches every
	// snapshot.
	Snapshot string
	// Node restricts the fault to calls about one node id. Empty matches
	// every node.
	Node string
	// Code is the gRPC code returned; required and not OK.
	Code codes.Code
	// Message is the error message; a default naming the fault is used when
	// empty.
	Message string
	// Times is how many matching calls fail before the fault disappears; 0
	// means every matching call fails until ClearFaults.
	Times int
	// ApplyAnyway lets the backend carry out the operation and only then
	// report the error, like a cloud whose answer is lost on the way back.
	ApplyAnyway bool
}

// err returns the gRPC error the fault produces.
func (f Fault) err() error {
	msg := f.Message
	if msg == "" {
		msg = fmt.Sprintf("injected %s fault", f.Method)
	}
	return status.Error(f.Code, msg)
}

// matches reports whether the fault applies to a call.
func (f Fault) matches(spec opSpec) bool {
	if f.Method != spec.method {
		return false
	}
	if f.Volume != "" && f.Volume != spec.volumeID && f.Volume != spec.volumeName && !slices.Contains(spec.sourceVolumeIDs, f.Volume) {
		return false
	}
	if f.Snapshot != "" && f.Snapshot != spec.snapshotID && f.Snapshot != spec.snapshotName &&
		f.Snapshot != spec.groupSnapshotID && f.Snapshot != spec.groupSnapshotName {
		return false
	}
	return f.Node == "" || f.Node == spec.nodeID
}

// InjectFault adds a fault. Faults are tried in the order they were added and
// the first match wins. Calls already running are not affected.
func (b *Backend) InjectFault(f Fault) error {
	if f.Method == "" {
		return fmt.Errorf("fault without a method")
	}
	if f.Code == codes.OK {
		return fmt.Errorf("fault for %s with code OK", f.Method)
	}
	if f.Times < 0 {
		return fmt.Errorf("fault for %s with negative Times %d", f.Method, f.Times)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.faults = append(b.faults, f)
	return nil
}

// ClearFaults removes every injected fault.
func (b *Backend) ClearFaults() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.faults = nil
}

// takeFaultLocked returns the fault that applies to a starting call, if any,
// and uses up one of its Times. The caller holds b.mu.
func (b *Backend) takeFaultLocked(spec opSpec) *Fault {
	for i, f := range b.faults {
		if !f.matches(spec) {
			continue
		}
		if f.Times > 0 {
			b.faults[i].Times--
			if b.faults[i].Times == 0 {
				b.faults = slices.Delete(b.faults, i, i+1)
			}
		}
		return &f
	}
	return nil
}

// SetLatency changes the default latency of backend operations (see
// Config.Latency). It affects operations that start afterwards.
func (b *Backend) SetLatency(d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.latency = max(d, 0)
}

// SetMethodLatency makes every later call of method take d, overriding the
// default latency.
func (b *Backend) SetMethodLatency(method string, d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.methodLatency[method] = max(d, 0)
}

// ClearMethodLatency removes the override for method, so that it takes the
// default latency again.
func (b *Backend) ClearMethodLatency(method string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.methodLatency, method)
}

// Hold makes the calls of method that start from now on wait in the backend,
// after their latency, until release is called: a test that needs a call still
// running when something happens makes it so, instead of hoping that a latency
// outlasts it. A caller that gives up on a held call sees it cancelled, as with
// latency, while the operation itself waits for the release and then runs to its
// end. Calls that start after the release are not held. Holding a held method
// again releases nothing: each release is for the calls held since its Hold.
func (b *Backend) Hold(method string) (release func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	gate := make(chan struct{})
	b.holds[method] = gate
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			if b.holds[method] == gate {
				delete(b.holds, method)
			}
			b.mu.Unlock()
			close(gate)
		})
	}
}

// latencyLocked is how long an operation of method takes now. The caller
// holds b.mu.
func (b *Backend) latencyLocked(method string) time.Duration {
	if d, ok := b.methodLatency[method]; ok {
		return d
	}
	if usesBackendLatency(method) {
		return b.latency
	}
	return 0
}
