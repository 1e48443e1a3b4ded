package realloop

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// handover is what happened to one sidecar's Lease at a step of a rolling upgrade, from the
// Lease watch, the driver's journal and the old replica's log: where the time between the
// SIGTERM and the new leader's first driver call went.
type handover struct {
	sidecar string
	// stopping: the old process logged that it stopped taking work (zero if not seen);
	// released: the holder was emptied; taken: a new holder's record was written, by
	// taker; firstCall: that process's first driver call for the sidecar after it.
	stopping, released, taken, firstCall time.Time
	taker                                string
	// The old process's API writes (Lease writes left out) from the SIGTERM to the release:
	// how many were sent, how many had waited for a token of its budget (more than
	// 50 ms: client-go logs no shorter wait), the longest wait and the time from the SIGTERM
	// to the last one sent. In combined mode the process's writes are of all its sidecars.
	drainWrites, drainThrottled int
	drainLongestWait            time.Duration
	lastDrainWrite              time.Time
}

// sidecarMethods are the driver calls each sidecar makes for the workload.
var sidecarMethods = map[string][]string{
	"provisioner": {testdriver.MethodCreateVolume, testdriver.MethodDeleteVolume},
	"attacher":    {testdriver.MethodControllerPublishVolume, testdriver.MethodControllerUnpublishVolume},
	"resizer":     {testdriver.MethodControllerExpandVolume, testdriver.MethodControllerModifyVolume},
}

// handovers is each Lease the old replica held at the step's SIGTERM, as handed over.
func (r *rolling) handovers(st step, byID map[string]*podReplica, changes func(lease string) []e2e.LeaseChange) []handover {
	var out []handover
	for _, lease := range st.held {
		sc := r.leaseOf[lease]
		h := handover{sidecar: sc}
		var released time.Time
		h.taker, h.taken, released = nextHolder(changes(lease), st.old.id, st.signalled)
		h.released = released
		if taker := byID[h.taker]; taker != nil && taker.bySidecar[sc] != nil {
			socket := taker.bySidecar[sc].Socket
			for _, c := range r.journal {
				if c.Socket == socket && slices.Contains(sidecarMethods[sc], c.Method) && !c.Start.Before(h.taken) {
					h.firstCall = c.Start
					break
				}
			}
		}
		old := st.old.bySidecar[sc]
		end := h.released
		if end.IsZero() {
			end = st.exited
		}
		for _, l := range r.procLines {
			if old == nil || l.proc != old.Name {
				continue
			}
			switch {
			case l.kind == "lifecycle" && strings.HasPrefix(l.text, `"Stopping`) && h.stopping.IsZero() && !l.at.Before(st.signalled.Add(-time.Second)):
				h.stopping = l.at
			case l.kind == "request" && l.verb != "GET" && !strings.HasPrefix(l.path, "leases/") && l.start().After(st.signalled) && !l.start().After(end):
				h.drainWrites++
				h.lastDrainWrite = later(h.lastDrainWrite, l.start())
			case l.kind == "throttled" && !strings.HasPrefix(l.path, "leases/") && l.at.After(st.signalled) && !l.at.After(end):
				h.drainThrottled++
				h.drainLongestWait = max(h.drainLongestWait, l.took)
			}
		}
		out = append(out, h)
	}
	return out
}

// shares splits the stall among the phases of the handover: before the SIGTERM, the old
// leader draining (SIGTERM to release), the Lease free (release to the new record), the new
// leader before its first driver call, and after that call.
func (h handover) shares(stall interval, signalled time.Time) (before, draining, free, starting time.Duration) {
	overlap := func(from, to time.Time) time.Duration {
		if from.IsZero() || to.IsZero() {
			return 0
		}
		return interval{later(from, stall.from), earlier(to, stall.to)}.length()
	}
	released, taken, first := h.released, h.taken, h.firstCall
	if released.IsZero() {
		released = taken // a record replaced without a release seen in between
	}
	if first.IsZero() {
		first = stall.to
	}
	return overlap(stall.from, signalled), overlap(signalled, released), overlap(released, taken), overlap(taken, first)
}

// String is the handover's times from the SIGTERM.
func (h handover) String(signalled time.Time) string {
	ms := func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return fmt.Sprintf("%+d", t.Sub(signalled).Milliseconds())
	}
	s := fmt.Sprintf("%s: stopping %s, released %s, taken %s by %s, first call %s ms", h.sidecar, ms(h.stopping), ms(h.released), ms(h.taken), h.taker, ms(h.firstCall))
	if h.drainWrites > 0 || h.drainThrottled > 0 {
		s += fmt.Sprintf("; the old process's drain: %d writes, the last sent at %s ms, %d after a wait for a token (longest %v)",
			h.drainWrites, ms(h.lastDrainWrite), h.drainThrottled, h.drainLongestWait.Round(time.Millisecond))
	}
	return s
}

// breakdown says where a step's stall went: per Lease handed over, its handover's times and
// the stall's share in each phase.
func (r *rolling) breakdown(st step) string {
	if st.stall.length() == 0 {
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "stall %+d..%+d ms from SIGTERM (%v)", st.stall.from.Sub(st.signalled).Milliseconds(), st.stall.to.Sub(st.signalled).Milliseconds(),
		st.stall.length().Round(time.Millisecond))
	for _, h := range st.handed {
		before, draining, free, starting := h.shares(st.stall, st.signalled)
		fmt.Fprintf(&b, "\n    %s\n      stall's share: before SIGTERM %v, old leader draining %v, Lease free %v, new leader before its first call %v",
			h.String(st.signalled), before.Round(time.Millisecond), draining.Round(time.Millisecond), free.Round(time.Millisecond), starting.Round(time.Millisecond))
	}
	return b.String()
}
