// Each record event decoded once: the informer's index, its handlers and every claim's
// sync ask of the same events again and again.

package record

import (
	"encoding/json"
	"slices"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// decodedEvents keeps what each record event carries, decoded once per version of the
// event: the list of its records (JSON) when it is first indexed, each record itself
// (protobuf JSON) when it is first read. An event leaves it when the informer deletes it.
type decodedEvents struct {
	mu     sync.Mutex
	events map[types.UID]*decodedEvent
}

// decodedEvent is one version of an event, decoded.
type decodedEvent struct {
	version string
	carried []Carried
	// also is where the further records start in carried (1 when the event opens a
	// record of the claim it is about, else 0).
	also int
	// records are carried's records decoded, nil until read; errs their errors.
	records []*Record
	errs    []error
}

// of is what ev carries: from the memory when this version was decoded before. Without a
// UID (an event made by a test, not the API server) it is decoded and not kept.
func (d *decodedEvents) of(ev *v1.Event) *decodedEvent {
	if d == nil || ev.UID == "" {
		return newDecoded(ev)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if e, ok := d.events[ev.UID]; ok && e.version == ev.ResourceVersion {
		return e
	}
	if d.events == nil {
		d.events = map[types.UID]*decodedEvent{}
	}
	e := newDecoded(ev)
	d.events[ev.UID] = e
	return e
}

// forget drops a deleted event.
func (d *decodedEvents) forget(ev *v1.Event) {
	if d == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.events, ev.UID)
}

func newDecoded(ev *v1.Event) *decodedEvent {
	carried := recordsIn(ev)
	e := &decodedEvent{version: ev.ResourceVersion, carried: carried, records: make([]*Record, len(carried)), errs: make([]error, len(carried))}
	if _, ok := ev.Annotations[AnnProvisioning]; ok {
		e.also = 1
	}
	return e
}

// record is the i-th carried record, decoded once. The caller gets its own copy, whose
// Claim it may set; the request is shared and read only.
func (d *decodedEvents) record(e *decodedEvent, i int) (*Record, error) {
	if d != nil {
		d.mu.Lock()
		defer d.mu.Unlock()
	}
	if e.records[i] == nil && e.errs[i] == nil {
		e.records[i], e.errs[i] = Decode(e.carried[i].Record)
	}
	if e.errs[i] != nil {
		return nil, e.errs[i]
	}
	r := *e.records[i]
	return &r, nil
}

// claimKeys are the UIDs of the claims ev is about (e is ev decoded): its label's, and
// those of the further records it carries.
func (e *decodedEvent) claimKeys(ev *v1.Event) []string {
	var out []string
	if uid := ev.Labels[LabelClaim]; uid != "" {
		out = append(out, uid)
	}
	for _, r := range e.carried[e.also:] {
		if !slices.Contains(out, string(r.Claim.UID)) {
			out = append(out, string(r.Claim.UID))
		}
	}
	return out
}

// recordsIn lists the records an event carries: that of the claim it is about, if it
// opens one, then the further ones. A further record about a claim of another namespace
// is no record: only who may write events in a claim's namespace may record for it.
func recordsIn(ev *v1.Event) []Carried {
	var out []Carried
	if value, ok := ev.Annotations[AnnProvisioning]; ok {
		out = append(out, Carried{Claim: ev.InvolvedObject, Record: value})
	}
	return append(out, alsoRecorded(ev)...)
}

func alsoRecorded(ev *v1.Event) []Carried {
	value, ok := ev.Annotations[AnnAlso]
	if !ok {
		return nil
	}
	var also []Carried
	if err := json.Unmarshal([]byte(value), &also); err != nil {
		return nil
	}
	return slices.DeleteFunc(also, func(r Carried) bool { return r.Claim.Namespace != ev.Namespace || r.Claim.UID == "" })
}
