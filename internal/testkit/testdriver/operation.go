package testdriver

import (
	"context"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// opSpec describes a call for the journal, fault matching and the overlap
// detector.
type opSpec struct {
	socket            string
	method            string
	volumeID          string
	volumeName        string
	nodeID            string
	snapshotID        string
	snapshotName      string
	groupSnapshotID   string
	groupSnapshotName string
	sourceVolumeIDs   []string
	snapshotIDs       []string
	secretKeys        []string
	requisite         []string
}

type opResult[T any] struct {
	value T
	err   error
}

// runOp journals a call and runs apply as a backend operation: after the
// method's latency and, for a held method (Hold), once it is released, with the
// backend lock held. The handler waits for the
// operation or for ctx, whichever ends first; the operation itself always
// runs to its end, as a cloud API keeps working on a request whose client
// went away. apply may fill in the journal entry (e.g. the id CreateVolume
// created).
func runOp[T any](ctx context.Context, b *Backend, spec opSpec, apply func(call *Call) (T, error)) (T, error) {
	b.mu.Lock()
	seq := b.startLocked(spec)
	if deadline, ok := ctx.Deadline(); ok {
		b.calls[seq].Deadline = time.Until(deadline)
	}
	latency := b.latencyLocked(spec.method)
	held := b.holds[spec.method]
	fault := b.takeFaultLocked(spec)
	b.mu.Unlock()

	done := make(chan opResult[T], 1)
	go func() {
		if latency > 0 {
			time.Sleep(latency)
		}
		if held != nil {
			<-held
		}
		v, err := finishOp(ctx, b, seq, fault, apply)
		done <- opResult[T]{v, err}
	}()

	select {
	case r := <-done:
		return r.value, r.err
	case <-ctx.Done():
		// Prefer a result that is already there over reporting a
		// cancellation that came in the same instant.
		select {
		case r := <-done:
			return r.value, r.err
		default:
		}
		b.mu.Lock()
		b.calls[seq].CallerGone = time.Now()
		b.notifyLocked()
		b.mu.Unlock()
		var zero T
		return zero, status.FromContextError(ctx.Err()).Err()
	}
}

// finishOp applies the operation (unless a fault forbids it) and closes its
// journal entry.
func finishOp[T any](ctx context.Context, b *Backend, seq int, fault *Fault, apply func(call *Call) (T, error)) (T, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var (
		v   T
		err error
	)
	if fault == nil || fault.ApplyAnyway {
		v, err = apply(&b.calls[seq])
	}
	if fault != nil {
		var zero T
		v, err = zero, fault.err()
	}
	// ctx is only done here if the caller gave up (or its connection broke)
	// before the operation ended: gRPC cancels it only after the handler,
	// which is still waiting for us, has returned.
	b.endLocked(seq, err, ctx.Err() != nil)
	return v, err
}

// reject journals a call that fails before reaching the backend (invalid
// arguments, unadvertised capability) and returns err.
func (b *Backend) reject(spec opSpec, err error) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	seq := b.startLocked(spec)
	b.endLocked(seq, err, false)
	return err
}

// startLocked appends a running call to the journal and registers it with
// the overlap detector. The caller holds b.mu.
func (b *Backend) startLocked(spec opSpec) int {
	seq := len(b.calls)
	b.calls = append(b.calls, Call{
		Seq:               seq,
		Socket:            spec.socket,
		Method:            spec.method,
		VolumeID:          spec.volumeID,
		VolumeName:        spec.volumeName,
		NodeID:            spec.nodeID,
		SnapshotID:        spec.snapshotID,
		SnapshotName:      spec.snapshotName,
		GroupSnapshotID:   spec.groupSnapshotID,
		GroupSnapshotName: spec.groupSnapshotName,
		SourceVolumeIDs:   joinList(spec.sourceVolumeIDs),
		SnapshotIDs:       joinList(spec.snapshotIDs),
		SecretKeys:        joinList(spec.secretKeys),
		Requisite:         strings.Join(spec.requisite, " "),
		Start:             time.Now(),
	})
	if isMutating(spec.method) {
		b.trackLocked(seq, b.overlapKeysLocked(spec))
	}
	b.notifyLocked()
	return seq
}

// endLocked records the result of a call and wakes waiters. The caller holds
// b.mu.
func (b *Backend) endLocked(seq int, err error, canceled bool) {
	st := status.Convert(err)
	c := &b.calls[seq]
	c.End = time.Now()
	c.Code = st.Code().String()
	c.Message = st.Message()
	c.Canceled = canceled
	b.untrackLocked(seq)
	klog.V(4).InfoS("Backend operation ended", "socket", c.Socket, "method", c.Method,
		"volumeID", c.VolumeID, "volumeName", c.VolumeName, "nodeID", c.NodeID,
		"snapshotID", c.SnapshotID, "snapshotName", c.SnapshotName,
		"groupSnapshotID", c.GroupSnapshotID, "groupSnapshotName", c.GroupSnapshotName,
		"secretKeys", c.SecretKeys,
		"code", c.Code, "message", c.Message, "canceled", c.Canceled, "duration", c.End.Sub(c.Start))
	b.writeJournalLocked(*c)
	b.notifyLocked()
}

// overlapKeysLocked names what a mutating call touches. CreateVolume is known
// by its name and, when the name already exists, by that volume's id too, so
// that a retried CreateVolume overlapping a DeleteVolume is caught.
func (b *Backend) overlapKeysLocked(spec opSpec) []string {
	if isSnapshotMethod(spec.method) {
		return b.snapshotOverlapKeysLocked(spec)
	}
	var keys []string
	if spec.volumeID != "" {
		keys = append(keys, spec.volumeID)
	}
	if spec.volumeName != "" {
		keys = append(keys, "name:"+spec.volumeName)
		if v := b.volumeByNameLocked(spec.volumeName); v != nil && v.ID != spec.volumeID {
			keys = append(keys, v.ID)
		}
	}
	return keys
}

// trackLocked flags overlaps of a starting operation with every running one
// on the same keys and marks it running.
func (b *Backend) trackLocked(seq int, keys []string) {
	seen := map[int]bool{}
	for _, key := range keys {
		for _, other := range b.running[key] {
			if !seen[other] {
				seen[other] = true
				b.overlaps = append(b.overlaps, overlapRef{key: key, first: other, second: seq})
			}
		}
		b.running[key] = append(b.running[key], seq)
	}
	if len(keys) > 0 {
		b.runningKeys[seq] = keys
	}
}

// untrackLocked marks an operation as no longer running in the backend.
func (b *Backend) untrackLocked(seq int) {
	for _, key := range b.runningKeys[seq] {
		b.running[key] = slices.DeleteFunc(b.running[key], func(s int) bool { return s == seq })
		if len(b.running[key]) == 0 {
			delete(b.running, key)
		}
	}
	delete(b.runningKeys, seq)
}

// Overlap key prefixes of the names requested by CreateSnapshot and
// CreateVolumeGroupSnapshot (CreateVolume's is "name:").
const (
	snapshotNameKey = "snapshot-name:"
	groupNameKey    = "group-name:"
)

// snapshotOverlapKeysLocked names what a mutating snapshot call touches: the
// snapshot or group snapshot by id and by requested name, the id a requested
// name already has, and the members of a group snapshot, so that a retried
// create overlapping a delete, or a DeleteSnapshot of a member overlapping
// the group's deletion, is caught.
func (b *Backend) snapshotOverlapKeysLocked(spec opSpec) []string {
	var keys []string
	add := func(key string) {
		if key != "" && !slices.Contains(keys, key) {
			keys = append(keys, key)
		}
	}
	addGroup := func(g *GroupSnapshot) {
		if g == nil {
			return
		}
		add(g.ID)
		for _, id := range g.SnapshotIDs {
			add(id)
		}
	}
	add(spec.snapshotID)
	if spec.snapshotName != "" {
		add(snapshotNameKey + spec.snapshotName)
		if s := b.snapshotByNameLocked(spec.snapshotName); s != nil {
			add(s.ID)
		}
	}
	add(spec.groupSnapshotID)
	addGroup(b.groupSnapshots[spec.groupSnapshotID])
	if spec.groupSnapshotName != "" {
		add(groupNameKey + spec.groupSnapshotName)
		addGroup(b.groupSnapshotByNameLocked(spec.groupSnapshotName))
	}
	for _, id := range spec.snapshotIDs {
		add(id)
	}
	return keys
}
