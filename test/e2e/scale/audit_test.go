package scale

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
)

// auditUpTo returns the audit log once it holds every request received before now.
func auditUpTo(ctx context.Context, client kubernetes.Interface) ([]audit.Event, error) {
	return audit.UpTo(ctx, client, auditLog)
}

// requests is what one user asked the API server for in a window.
type requests struct {
	all []audit.Event
	// byKind counts requests by "verb resource", lists by resource, writes by "verb
	// resource" without the Lease's (renewals are no work), and settledWrites the writes
	// to objects that were settled before the work began.
	byKind, lists, writes, settledWrites map[string]int
	leaseWrites, failed                  int
}

// requestsOf sorts the requests of user received in [from, to); settled tells whether a
// written object was settled before.
func requestsOf(events []audit.Event, user string, from, to time.Time, settled func(audit.Event) bool) requests {
	r := requests{byKind: map[string]int{}, lists: map[string]int{}, writes: map[string]int{}, settledWrites: map[string]int{}}
	for _, e := range events {
		if e.User.Username != user || e.RequestReceived.Before(from) || !e.RequestReceived.Before(to) {
			continue
		}
		r.all = append(r.all, e)
		kind := e.Verb + " " + e.Resource()
		r.byKind[kind]++
		if e.Failed() {
			r.failed++
		}
		if e.IsList() {
			r.lists[e.Resource()]++
		}
		if !e.IsWrite() {
			continue
		}
		if e.Resource() == "leases" {
			r.leaseWrites++
			continue
		}
		r.writes[kind]++
		if settled(e) {
			r.settledWrites[kind]++
		}
	}
	return r
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// format lists m as "k1 n1, k2 n2" in key order, "-" when empty.
func format(m map[string]int) string {
	if len(m) == 0 {
		return "-"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}
