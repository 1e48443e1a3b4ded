package audit

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// FailedCodes are the answers a Tally counts as failed writes: 409 Conflict, 404 Not Found
// and 429 Too Many Requests, in that order.
var FailedCodes = []int{409, 404, 429}

// Tally is what one client asked for one kind of operation, for tables of API writes per
// operation: its writes, failed ones by code and all by kind, and its GETs.
type Tally struct {
	Ops    int            // operations of this kind
	Writes int            // write requests, failed ones included
	Failed map[int]int    // failed writes by HTTP status code (FailedCodes only)
	ByKind map[string]int // writes by "verb resource"
	Gets   int            // GET requests (logged only when the policy logs them)
}

// NewTally is an empty Tally.
func NewTally() *Tally { return &Tally{Failed: map[int]int{}, ByKind: map[string]int{}} }

// Add counts e: a write as a write of its kind (and a failed one when answered with one of
// FailedCodes), a GET as a GET; other requests are not counted.
func (t *Tally) Add(e Event) {
	switch {
	case e.IsWrite():
		t.Writes++
		t.ByKind[e.Verb+" "+e.Resource()]++
		if slices.Contains(FailedCodes, e.Code()) {
			t.Failed[e.Code()]++
		}
	case e.Verb == "get":
		t.Gets++
	}
}

// PerOp is the writes per operation, 0 without operations.
func (t *Tally) PerOp() float64 {
	if t.Ops == 0 {
		return 0
	}
	return float64(t.Writes) / float64(t.Ops)
}

// PerOpString is PerOp with two decimals, or the writes' number in parentheses when there
// were no operations.
func (t *Tally) PerOpString() string {
	if t.Ops == 0 {
		return fmt.Sprintf("(%d writes)", t.Writes)
	}
	return fmt.Sprintf("%.2f", t.PerOp())
}

// PerOpOf is n per operation with two decimals; n itself when 0 or without operations.
func (t *Tally) PerOpOf(n int) string {
	if t.Ops == 0 || n == 0 {
		return fmt.Sprint(n)
	}
	return fmt.Sprintf("%.2f", float64(n)/float64(t.Ops))
}

// FailedString is the failed writes per operation by code in the order of FailedCodes,
// separated by slashes ("0/0.25/0"), or "0" when none failed.
func (t *Tally) FailedString() string {
	var parts []string
	total := 0
	for _, code := range FailedCodes {
		total += t.Failed[code]
		parts = append(parts, t.PerOpOf(t.Failed[code]))
	}
	if total == 0 {
		return "0"
	}
	return strings.Join(parts, "/")
}

// Kinds lists the writes by kind, sorted, per operation when there were operations:
// "create events 1.00, patch volumesnapshotcontents 2.00".
func (t *Tally) Kinds() string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(t.ByKind)) {
		parts = append(parts, k+" "+t.PerOpOf(t.ByKind[k]))
	}
	return strings.Join(parts, ", ")
}

// EventBody is what the request body of an event's write (logged at level Request) says
// about its object and its writer: the fields of core/v1 and of events.k8s.io/v1 Events.
type EventBody struct {
	InvolvedObject      ObjectRef                  `json:"involvedObject"`
	Regarding           ObjectRef                  `json:"regarding"`
	Source              struct{ Component string } `json:"source"`
	DeprecatedSource    struct{ Component string } `json:"deprecatedSource"`
	ReportingComponent  string                     `json:"reportingComponent"`
	ReportingController string                     `json:"reportingController"`
}

// ObjectRef is the object an event is about.
type ObjectRef struct{ Kind, Namespace, Name string }

// Object is the object the event is about (involvedObject, else regarding).
func (b EventBody) Object() ObjectRef {
	if b.InvolvedObject.Kind != "" {
		return b.InvolvedObject
	}
	return b.Regarding
}

// Component is the event's writer as it names itself: its source's component, else its
// reporting component or controller.
func (b EventBody) Component() string {
	for _, c := range []string{b.Source.Component, b.ReportingComponent, b.ReportingController, b.DeprecatedSource.Component} {
		if c != "" {
			return c
		}
	}
	return ""
}

// EventBodies are the bodies of the events created so far, by namespace/name: an event's
// later writes (the correlator's count patches) carry no body naming its object. Give Of
// every write of events in the log's order.
type EventBodies map[string]*EventBody

// Of is the body of the event e writes: e's own when it names an object (remembered when e
// creates or replaces the event), else the one remembered for the event; nil when none.
func (m EventBodies) Of(e Event) *EventBody {
	key := e.Namespace() + "/" + e.Name()
	if len(e.RequestObject) == 0 {
		return m[key]
	}
	var body EventBody
	if err := json.Unmarshal(e.RequestObject, &body); err != nil || body.Object().Kind == "" {
		return m[key]
	}
	if e.Verb == "create" || e.Verb == "update" {
		m[key] = &body
	}
	return &body
}
