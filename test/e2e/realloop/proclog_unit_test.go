package realloop

import (
	"testing"
	"time"
)

// A replica's log gives the timeline its requests (answered, with their time on the wire),
// its waits for a token and the core's drain and Lease lines; other lines are left out.
func TestParseProcLogKeepsRequestsWaitsAndTheCoresLines(t *testing.T) {
	now := time.Date(2026, 12, 2, 8, 0, 0, 0, time.Local)
	log := `I1202 07:10:01.100000   42 member.go:300] "Stopping: taking no new work, draining in-flight operations" reason="signal"
I1202 07:10:01.250000   42 request.go:685] "Waited before sending request" delay="812.5ms" reason="client-side throttling, not priority and fairness" verb="PATCH" URL="https://127.0.0.1:4443/api/v1/namespaces/ns/persistentvolumeclaims/roll-003/status"
I1202 07:10:01.262000   42 round_trippers.go:632] "Response" verb="PATCH" url="https://127.0.0.1:4443/api/v1/namespaces/ns/persistentvolumeclaims/roll-003/status" status="200 OK" milliseconds=12
I1202 07:10:01.270000   42 round_trippers.go:632] "Response" verb="GET" url="https://127.0.0.1:4443/api/v1/persistentvolumes?allowWatchBookmarks=true&watch=true" status="200 OK" milliseconds=30000
I1202 07:10:01.300000   42 round_trippers.go:632] "Response" verb="PUT" url="https://127.0.0.1:4443/apis/coordination.k8s.io/v1/namespaces/ns/leases/external-resizer-x" status="200 OK" milliseconds=5
I1202 07:10:01.400000   42 controller.go:10] "Something else"
not a klog line
I1202 07:10:01.500000   42 member.go:420] "Released the Lease" lease="external-resizer-x"
`
	got := parseProcLog("ours-0-resizer", log, now)
	at := func(s string) time.Time {
		t.Helper()
		tm, err := time.ParseInLocation("2006-01-02 15:04:05.000000", "2026-12-02 "+s, time.Local)
		if err != nil {
			t.Fatal(err)
		}
		return tm
	}
	want := []procLine{
		{at: at("07:10:01.100000"), proc: "ours-0-resizer", kind: "lifecycle", text: `"Stopping: taking no new work, draining in-flight operations" reason="signal"`},
		{at: at("07:10:01.250000"), proc: "ours-0-resizer", kind: "throttled", verb: "PATCH", path: "persistentvolumeclaims/roll-003/status", took: 812500 * time.Microsecond},
		{at: at("07:10:01.262000"), proc: "ours-0-resizer", kind: "request", verb: "PATCH", path: "persistentvolumeclaims/roll-003/status", status: "200 OK", took: 12 * time.Millisecond},
		{at: at("07:10:01.300000"), proc: "ours-0-resizer", kind: "request", verb: "PUT", path: "leases/external-resizer-x", status: "200 OK", took: 5 * time.Millisecond},
		{at: at("07:10:01.500000"), proc: "ours-0-resizer", kind: "lifecycle", text: `"Released the Lease" lease="external-resizer-x"`},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d lines, want %d:\n%v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("line %d:\n got %+v\nwant %+v", i, got[i], want[i])
		}
	}
	if s := got[1].start(); !s.Equal(at("07:10:00.437500")) {
		t.Errorf("the wait began at %v, want 07:10:00.4375", s)
	}
}

// A stall is split among the phases of a handover: before the SIGTERM, the old leader's
// drain, the Lease free, the new leader before its first call.
func TestHandoverSharesSplitTheStall(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	h := handover{sidecar: "provisioner", released: at(700), taken: at(750), firstCall: at(900)}
	before, draining, free, starting := h.shares(interval{at(-200), at(1000)}, at(0))
	if before != 200*time.Millisecond || draining != 700*time.Millisecond || free != 50*time.Millisecond || starting != 150*time.Millisecond {
		t.Errorf("shares: before %v, draining %v, free %v, starting %v; want 200, 700, 50, 150 ms", before, draining, free, starting)
	}
	// A stall that ends before the release lies in the drain only.
	before, draining, free, starting = h.shares(interval{at(100), at(400)}, at(0))
	if before != 0 || draining != 300*time.Millisecond || free != 0 || starting != 0 {
		t.Errorf("shares of a stall in the drain: %v %v %v %v; want 0, 300 ms, 0, 0", before, draining, free, starting)
	}
}
