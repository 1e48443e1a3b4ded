package scale

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// auditEvent is what the tests read of an audit.k8s.io/v1 Event at Metadata level.
type auditEvent struct {
	AuditID    string `json:"auditID"`
	Stage      string `json:"stage"`
	RequestURI string `json:"requestURI"`
	Verb       string `json:"verb"`
	User       struct {
		Username string `json:"username"`
	} `json:"user"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
	RequestReceived time.Time `json:"requestReceivedTimestamp"`
	StageTimestamp  time.Time `json:"stageTimestamp"`
}

// resource is the event's resource and subresource ("persistentvolumeclaims/status"), or
// its URI for a request that is not about a resource.
func (e auditEvent) resource() string {
	if e.ObjectRef == nil || e.ObjectRef.Resource == "" {
		path, _, _ := strings.Cut(e.RequestURI, "?")
		return path
	}
	if e.ObjectRef.Subresource != "" {
		return e.ObjectRef.Resource + "/" + e.ObjectRef.Subresource
	}
	return e.ObjectRef.Resource
}

// isList tells whether the request read a whole collection: a LIST, or a watch that
// starts by sending every object (sendInitialEvents, client-go's WatchList), which costs
// the API server the same.
func (e auditEvent) isList() bool {
	return e.Verb == "list" || e.Verb == "watch" && strings.Contains(e.RequestURI, "sendInitialEvents=true")
}

func (e auditEvent) isWrite() bool {
	switch e.Verb {
	case "create", "update", "patch", "delete", "deletecollection":
		return true
	}
	return false
}

func (e auditEvent) failed() bool { return e.ResponseStatus != nil && e.ResponseStatus.Code >= 400 }

// readAudit reads every request in the audit log, one event per request: the one of its
// last stage written so far (a watch that is still open has only ResponseStarted).
func readAudit(path string) ([]auditEvent, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	byID := map[string]int{}
	var out []auditEvent
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var e auditEvent
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			return nil, fmt.Errorf("audit log line %q: %w", sc.Text(), err)
		}
		if i, ok := byID[e.AuditID]; ok {
			out[i] = e
			continue
		}
		byID[e.AuditID] = len(out)
		out = append(out, e)
	}
	return out, sc.Err()
}

var markers atomic.Int64

// auditUpTo returns the audit log once it holds every request received before now: it
// sends a marker request (GET /version as the admin, which the policy logs) and waits
// until the marker is in the log.
func auditUpTo(ctx context.Context, client kubernetes.Interface) ([]auditEvent, error) {
	id := strconv.FormatInt(markers.Add(1), 10)
	if _, err := client.Discovery().RESTClient().Get().AbsPath("/version").Param("audit-marker", id).DoRaw(ctx); err != nil {
		return nil, fmt.Errorf("sending the audit marker: %w", err)
	}
	var events []auditEvent
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		var err error
		if events, err = readAudit(auditLog); err != nil {
			return false, err
		}
		for i := len(events) - 1; i >= 0; i-- {
			if strings.Contains(events[i].RequestURI, "audit-marker="+id) {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return nil, fmt.Errorf("waiting for audit marker %s in %s: %w", id, auditLog, err)
	}
	return events, nil
}

// requests is what one user asked the API server for in a window.
type requests struct {
	all []auditEvent
	// byKind counts requests by "verb resource", lists by resource, writes by "verb
	// resource" without the Lease's (renewals are no work), and settledWrites the writes
	// to objects that were settled before the work began.
	byKind, lists, writes, settledWrites map[string]int
	leaseWrites, failed                  int
}

// requestsOf sorts the requests of user received in [from, to); settled tells whether a
// written object was settled before.
func requestsOf(events []auditEvent, user string, from, to time.Time, settled func(auditEvent) bool) requests {
	r := requests{byKind: map[string]int{}, lists: map[string]int{}, writes: map[string]int{}, settledWrites: map[string]int{}}
	for _, e := range events {
		if e.User.Username != user || e.RequestReceived.Before(from) || !e.RequestReceived.Before(to) {
			continue
		}
		r.all = append(r.all, e)
		kind := e.Verb + " " + e.resource()
		r.byKind[kind]++
		if e.failed() {
			r.failed++
		}
		if e.isList() {
			r.lists[e.resource()]++
		}
		if !e.isWrite() {
			continue
		}
		if e.resource() == "leases" {
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
