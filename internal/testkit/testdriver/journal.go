package testdriver

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"k8s.io/klog/v2"
)

// Call is one journal entry: one RPC received by the driver.
type Call struct {
	// Seq is the call's index in the journal; calls are journaled in the
	// order they started.
	Seq int `json:"seq"`
	// Socket is the path of the UNIX socket whose server received the call.
	Socket string `json:"socket"`
	// Method is the RPC name, see the Method constants.
	Method string `json:"method"`
	// VolumeID is the volume the call is about. For CreateVolume it is empty
	// until the operation ends and then holds the id of the volume created or
	// found. For CreateSnapshot it is the source volume, for ListSnapshots
	// the source volume filter.
	VolumeID string `json:"volumeID,omitempty"`
	// VolumeName is the name requested by CreateVolume.
	VolumeName string `json:"volumeName,omitempty"`
	// NodeID is the node of (un)publish calls.
	NodeID string `json:"nodeID,omitempty"`
	// SnapshotID is the snapshot the call is about (DeleteSnapshot,
	// GetSnapshot, the snapshot_id filter of ListSnapshots). For
	// CreateSnapshot it is empty until the operation ends and then holds the
	// id of the snapshot cut or found.
	SnapshotID string `json:"snapshotID,omitempty"`
	// SnapshotName is the name requested by CreateSnapshot.
	SnapshotName string `json:"snapshotName,omitempty"`
	// GroupSnapshotID is the group snapshot the call is about (Delete- and
	// GetVolumeGroupSnapshot). For CreateVolumeGroupSnapshot it is empty
	// until the operation ends and then holds the id of the group snapshot
	// cut or found.
	GroupSnapshotID string `json:"groupSnapshotID,omitempty"`
	// GroupSnapshotName is the name requested by CreateVolumeGroupSnapshot.
	GroupSnapshotName string `json:"groupSnapshotName,omitempty"`
	// SourceVolumeIDs are the volumes CreateVolumeGroupSnapshot was asked to
	// snapshot, in request order, joined by commas (see SourceVolumeIDList).
	SourceVolumeIDs string `json:"sourceVolumeIDs,omitempty"`
	// SnapshotIDs are the member snapshot ids Delete- and
	// GetVolumeGroupSnapshot were given, in request order, joined by commas
	// (see SnapshotIDList). For CreateVolumeGroupSnapshot they are empty
	// until the operation ends and then hold the members of the group
	// snapshot cut or found.
	SnapshotIDs string `json:"snapshotIDs,omitempty"`
	// Requisite are the segments of CreateVolume's accessibility requirement, each as
	// "key=value,key=value" with its keys sorted, in request order, joined by spaces (see
	// RequisiteList).
	Requisite string `json:"requisite,omitempty"`
	// SecretKeys are the keys of the request's secrets field, sorted and
	// joined by commas (see SecretKeyList); empty when the request had no
	// secrets or has no such field. Secret values are never recorded.
	SecretKeys string `json:"secretKeys,omitempty"`
	// Start is when the driver received the call.
	Start time.Time `json:"start"`
	// Deadline is how long the caller gave the call, as its gRPC deadline said when the
	// call was received (never more than the caller's timeout); zero without a deadline.
	Deadline time.Duration `json:"deadline,omitempty"`
	// End is when the backend operation ended (not when the handler
	// returned); zero while it still runs.
	End time.Time `json:"end,omitzero"`
	// Code is the gRPC code name of the operation's result ("OK",
	// "NotFound", ...); empty while it still runs. When Canceled is set, this
	// is what the backend did, not what the caller was told.
	Code string `json:"code,omitempty"`
	// Message is the error message, empty on success.
	Message string `json:"message,omitempty"`
	// Canceled is set when the caller's context was done before the backend
	// operation ended: the caller got Canceled or DeadlineExceeded while the
	// operation went on.
	Canceled bool `json:"canceled,omitempty"`
	// CallerGone is when the caller gave up (cancelled, deadline, broken
	// connection) while the operation still ran; zero if it waited. Unlike
	// Canceled it is known at once, before the operation ends.
	CallerGone time.Time `json:"callerGone,omitzero"`
}

// Done reports whether the call's backend operation has ended.
func (c Call) Done() bool { return !c.End.IsZero() }

// SecretKeyList returns SecretKeys as a list; nil for none.
func (c Call) SecretKeyList() []string { return splitList(c.SecretKeys) }

// RequisiteList splits Requisite.
func (c Call) RequisiteList() []string { return strings.Fields(c.Requisite) }

// SourceVolumeIDList returns SourceVolumeIDs as a list; nil for none.
func (c Call) SourceVolumeIDList() []string { return splitList(c.SourceVolumeIDs) }

// SnapshotIDList returns SnapshotIDs as a list; nil for none.
func (c Call) SnapshotIDList() []string { return splitList(c.SnapshotIDs) }

// joinList is how lists are kept in a Call, which stays comparable.
func joinList(items []string) string { return strings.Join(items, ",") }

// splitList undoes joinList.
func splitList(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}

// Overlap records two mutating operations on one volume, snapshot or group
// snapshot that ran in the backend at the same time.
type Overlap struct {
	// Volume is the key both operations were matched by: a volume id
	// ("vol-..."), a snapshot id ("snap-...") or a group snapshot id
	// ("group-..."), or the name a create call requested: "name:<name>"
	// for CreateVolume, "snapshot-name:<name>" for CreateSnapshot,
	// "group-name:<name>" for CreateVolumeGroupSnapshot. Snapshot
	// operations are never matched by their source volume: snapshotting a
	// volume while it is published or while another snapshot of it is cut
	// is no overlap.
	Volume string
	// First was still running when Second started.
	First, Second Call
}

// SameSidecar reports whether both calls belong to one sidecar (SidecarOf):
// an overlap no replica of a sidecar may cause. Calls of two sidecars on one
// volume may overlap, in upstream's sidecars as in ours.
func (o Overlap) SameSidecar() bool {
	return SidecarOf(o.First.Method) == SidecarOf(o.Second.Method)
}

// overlapRef is how an overlap is kept: by journal index, so that Overlaps
// returns the calls as they are now (ended, with results).
type overlapRef struct {
	key           string
	first, second int
}

// Journal returns a copy of every call so far, in start order, including
// those still running.
func (b *Backend) Journal() []Call {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]Call(nil), b.calls...)
}

// CallsOf returns the calls of one method among calls (a Journal, or part of one).
func CallsOf(calls []Call, method string) []Call {
	var out []Call
	for _, c := range calls {
		if c.Method == method {
			out = append(out, c)
		}
	}
	return out
}

// Calls returns a copy of every call of method so far, in start order.
func (b *Backend) Calls(method string) []Call { return CallsOf(b.Journal(), method) }

// Overlaps returns every pair of mutating operations that ran on the same
// volume, snapshot or group snapshot at the same time (see Overlap.Volume),
// including operations whose caller had already cancelled.
func (b *Backend) Overlaps() []Overlap {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]Overlap, 0, len(b.overlaps))
	for _, o := range b.overlaps {
		out = append(out, Overlap{Volume: o.key, First: b.calls[o.first], Second: b.calls[o.second]})
	}
	return out
}

// WaitFor blocks until cond, given a copy of the journal, returns true. It
// re-evaluates cond each time a call starts or ends, so tests never need to
// sleep. It returns an error wrapping ctx.Err() when ctx ends first.
func (b *Backend) WaitFor(ctx context.Context, cond func([]Call) bool) error {
	for {
		b.mu.Lock()
		calls := append([]Call(nil), b.calls...)
		changed := b.changed
		b.mu.Unlock()
		if cond(calls) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for journal condition (%d calls so far): %w", len(calls), ctx.Err())
		case <-changed:
		}
	}
}

// notifyLocked wakes every WaitFor. The caller holds b.mu.
func (b *Backend) notifyLocked() {
	close(b.changed)
	b.changed = make(chan struct{})
}

// writeJournalLocked appends the finished call to Config.JournalWriter. It is
// called with b.mu held so that lines from concurrent calls never interleave.
func (b *Backend) writeJournalLocked(c Call) {
	if b.cfg.JournalWriter == nil {
		return
	}
	line, err := json.Marshal(c)
	if err != nil {
		klog.ErrorS(err, "Encoding journal entry", "method", c.Method, "seq", c.Seq)
		return
	}
	if _, err := b.cfg.JournalWriter.Write(append(line, '\n')); err != nil {
		klog.ErrorS(err, "Writing journal entry", "method", c.Method, "seq", c.Seq)
	}
}
