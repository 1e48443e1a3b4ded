package realloop

import (
	"slices"
	"strings"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cluster"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstream"
)

// opKey is an operation of a sidecar.
type opKey struct{ sidecar, op string }

// opOrder are the operations counted, in the order of the table. A write of a sidecar that
// is about none of the runs' volumes is counted under the operation "other".
var opOrder = []opKey{
	{"provisioner", "provision"},
	{"provisioner", "delete"},
	{"attacher", "attach"},
	{"attacher", "detach"},
	{"resizer", "expand"},
	{"resizer", "modify"},
}

// writeCounts are the writes by sidecar and operation.
type writeCounts map[opKey]*audit.Tally

// tally is k's Tally, created when there is none yet.
func (wc writeCounts) tally(k opKey) *audit.Tally {
	if wc[k] == nil {
		wc[k] = audit.NewTally()
	}
	return wc[k]
}

// others are the keys of writes that were about none of the runs' volumes.
func (wc writeCounts) others() []opKey {
	var out []opKey
	for k := range wc {
		if k.op == "other" {
			out = append(out, k)
		}
	}
	slices.SortFunc(out, func(a, b opKey) int { return strings.Compare(a.sidecar, b.sidecar) })
	return out
}

// attribution is what tells which sidecar and which operation a write was for.
type attribution struct {
	impl      implementation
	namespace string // the world's: its claims, Pods and their events
	driver    string
	items     []cluster.Item
}

// sidecarOf names the sidecar of the implementation that sent a request, "" for a request
// of another client. csi-sidecars' sidecars write with the user agent csi-sidecars/<sidecar>,
// except events, which each process writes through its shared client (csi-sidecars): those
// are told apart by their source component (the provisioner's is <driver>_<identity>, the
// harness's identity being the sidecar's name; the resizer's external-resizer <driver>).
// Upstream's binaries write with client-go's default user agent, which begins with the
// binary's name.
func (a attribution) sidecarOf(e audit.Event, body *audit.EventBody) string {
	if a.impl.upstream() {
		for _, r := range upstream.Releases() {
			if strings.HasPrefix(e.UserAgent, r.Cmd+"/") {
				return r.Sidecar
			}
		}
		return ""
	}
	if s, ok := strings.CutPrefix(e.UserAgent, "csi-sidecars/"); ok {
		return s
	}
	if e.UserAgent != "csi-sidecars" || body == nil {
		return ""
	}
	switch c := body.Component(); {
	case strings.HasPrefix(c, a.driver+"_"):
		return "provisioner"
	case strings.HasPrefix(c, "external-resizer"):
		return "resizer"
	case strings.HasPrefix(c, "external-attacher"):
		return "attacher"
	}
	return ""
}

// countWrites counts the writes of the implementation's sidecars received in [from, to),
// by operation, and the operations of each kind the items went through.
//
// A write is about one item (a Pod and its claim) when it writes the claim, the item's
// PersistentVolume or VolumeAttachment, or an event about one of them or the Pod. Its
// operation is the sidecar's for the item at that time: the provisioner's writes before
// the claim's deletion was requested provision, after it delete; the attacher's before the
// Pod was deleted attach, after it detach (its PersistentVolume finalizer's removal among
// them); the resizer's expand a claim that was grown and modify one given a new
// VolumeAttributesClass (whichever was asked last before the write). Lease writes are left
// out.
func countWrites(events []audit.Event, from, to time.Time, a attribution) writeCounts {
	byClaim, byPV, byVA := map[string]*cluster.Item{}, map[string]*cluster.Item{}, map[string]*cluster.Item{}
	for i := range a.items {
		it := &a.items[i]
		byClaim[it.Name] = it
		if it.PersistentVolume != "" {
			byPV[it.PersistentVolume] = it
		}
		if it.VolumeAttachment != "" {
			byVA[it.VolumeAttachment] = it
		}
	}
	itemOfObject := func(kind, namespace, name string) *cluster.Item {
		switch kind {
		case "PersistentVolumeClaim", "Pod":
			if namespace == a.namespace {
				return byClaim[name]
			}
		case "PersistentVolume":
			return byPV[name]
		case "VolumeAttachment":
			return byVA[name]
		}
		return nil
	}

	// An event's later writes carry no body with its object: EventBodies remembers them.
	bodies := audit.EventBodies{}

	out := writeCounts{}
	for _, e := range events {
		if !e.IsWrite() || e.Resource() == "leases" {
			continue
		}
		var body *audit.EventBody
		if strings.HasPrefix(e.Resource(), "events") {
			body = bodies.Of(e)
		}
		if e.RequestReceived.Before(from) || !e.RequestReceived.Before(to) {
			continue
		}
		sidecar := a.sidecarOf(e, body)
		if sidecar == "" {
			continue
		}
		var it *cluster.Item
		switch res := e.Resource(); {
		case body != nil:
			o := body.Object()
			it = itemOfObject(o.Kind, o.Namespace, o.Name)
		case strings.HasPrefix(res, "persistentvolumeclaims"):
			it = itemOfObject("PersistentVolumeClaim", e.Namespace(), e.Name())
		case strings.HasPrefix(res, "persistentvolumes"):
			it = itemOfObject("PersistentVolume", "", e.Name())
		case strings.HasPrefix(res, "volumeattachments"):
			it = itemOfObject("VolumeAttachment", "", e.Name())
		}
		out.tally(opKey{sidecar, operation(sidecar, it, e.RequestReceived)}).Add(e)
	}

	for i := range a.items {
		it := &a.items[i]
		for stage, k := range map[cluster.Stage]opKey{
			cluster.Provisioned:   {"provisioner", "provision"},
			cluster.VolumeDeleted: {"provisioner", "delete"},
			cluster.Attached:      {"attacher", "attach"},
			cluster.Detached:      {"attacher", "detach"},
			cluster.Grown:         {"resizer", "expand"},
			cluster.Modified:      {"resizer", "modify"},
		} {
			if it.Times[stage].IsZero() {
				continue
			}
			out.tally(k).Ops++
		}
	}
	return out
}

// operation is the sidecar's operation for item at time at, "other" when no item.
func operation(sidecar string, it *cluster.Item, at time.Time) string {
	if it == nil {
		return "other"
	}
	after := func(stage cluster.Stage) bool {
		t := it.Times[stage]
		return !t.IsZero() && !at.Before(t)
	}
	switch sidecar {
	case "provisioner":
		if after(cluster.ClaimDeleted) {
			return "delete"
		}
		return "provision"
	case "attacher":
		if after(cluster.PodDeleted) {
			return "detach"
		}
		return "attach"
	case "resizer":
		// The change asked last before the write; a write before either (none is
		// expected) is the first one's.
		grow, modify := it.Times[cluster.GrowRequested], it.Times[cluster.ModifyRequested]
		switch {
		case grow.IsZero() && modify.IsZero():
		case modify.IsZero():
			return "expand"
		case grow.IsZero():
			return "modify"
		case after(cluster.ModifyRequested) && (modify.After(grow) || !after(cluster.GrowRequested)):
			return "modify"
		case after(cluster.GrowRequested):
			return "expand"
		case grow.Before(modify):
			return "expand"
		default:
			return "modify"
		}
	}
	return "other"
}
