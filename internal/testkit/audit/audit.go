// Package audit reads a test kube-apiserver's audit log, so that end-to-end tests and
// benchmarks can count what each client asked the API server for: LISTs, writes, failed
// writes, by user or by user agent.
//
// Setup writes an audit policy and returns the kube-apiserver flags that log to a file as
// JSON lines (audit.k8s.io/v1 Events), one event written by each request's own handler
// (blocking mode), never rotated. Read parses the log into one Event per request; UpTo
// first makes sure the log holds every request received before it was called, by sending a
// marker request that the policy must log (MarkerRule). A Tally counts one client's
// requests for one kind of operation; EventBodies tells what an event's writes are about.
package audit

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// MarkerRule is the policy rule that logs UpTo's marker, a GET /version by the test control
// plane's admin; put it first in a policy's rules.
const MarkerRule = `- level: Metadata
  users: ["admin"]
  nonResourceURLs: ["/version"]
`

// WriteRules are policy rules that log every write at Metadata level, and the writes of
// events with their body (level Request: their involved object and source tell what they
// are about and who wrote them, see EventBody). Put them after MarkerRule.
const WriteRules = `- level: Request
  verbs: ["create", "update", "patch"]
  resources:
  - group: ""
    resources: ["events"]
  - group: "events.k8s.io"
    resources: ["events"]
- level: Metadata
  verbs: ["create", "update", "patch", "delete", "deletecollection"]
`

// Setup writes policy (an audit.k8s.io/v1 Policy in YAML) into dir and returns the
// kube-apiserver flags that apply it, logging to the file log in dir.
func Setup(dir, policy string) (args []string, log string, err error) {
	path := filepath.Join(dir, "audit-policy.yaml")
	if err := os.WriteFile(path, []byte(policy), 0o600); err != nil {
		return nil, "", fmt.Errorf("audit: writing the policy: %w", err)
	}
	log = filepath.Join(dir, "audit.log")
	return []string{
		"--audit-policy-file=" + path,
		"--audit-log-path=" + log,
		"--audit-log-format=json",
		// Each event is written by the request's own handler, not by a batching goroutine.
		"--audit-log-mode=blocking",
		// No rotation while a test reads the log: 0 would mean lumberjack's 100 MB.
		"--audit-log-maxsize=4096",
		"--audit-log-maxage=0",
		"--audit-log-maxbackup=0",
	}, log, nil
}

// Event is what tests read of an audit.k8s.io/v1 Event at Metadata level.
type Event struct {
	AuditID    string `json:"auditID"`
	Stage      string `json:"stage"`
	RequestURI string `json:"requestURI"`
	Verb       string `json:"verb"`
	User       struct {
		Username string `json:"username"`
	} `json:"user"`
	UserAgent string `json:"userAgent"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
	// RequestObject is the request's body, logged only at level Request and above.
	RequestObject   json.RawMessage `json:"requestObject,omitempty"`
	RequestReceived time.Time       `json:"requestReceivedTimestamp"`
	StageTimestamp  time.Time       `json:"stageTimestamp"`
}

// Resource is the event's resource and subresource ("persistentvolumeclaims/status"), or
// its URI's path for a request that is not about a resource.
func (e Event) Resource() string {
	if e.ObjectRef == nil || e.ObjectRef.Resource == "" {
		path, _, _ := strings.Cut(e.RequestURI, "?")
		return path
	}
	if e.ObjectRef.Subresource != "" {
		return e.ObjectRef.Resource + "/" + e.ObjectRef.Subresource
	}
	return e.ObjectRef.Resource
}

// Namespace and Name are the object's, "" when the request names none.
func (e Event) Namespace() string {
	if e.ObjectRef == nil {
		return ""
	}
	return e.ObjectRef.Namespace
}

func (e Event) Name() string {
	if e.ObjectRef == nil {
		return ""
	}
	return e.ObjectRef.Name
}

// IsList tells whether the request read a whole collection: a LIST, or a watch that starts
// by sending every object (sendInitialEvents, client-go's WatchList), which costs the API
// server the same.
func (e Event) IsList() bool {
	return e.Verb == "list" || e.Verb == "watch" && strings.Contains(e.RequestURI, "sendInitialEvents=true")
}

// IsWrite tells whether the request was a write: create, update, patch, delete or
// deletecollection.
func (e Event) IsWrite() bool {
	switch e.Verb {
	case "create", "update", "patch", "delete", "deletecollection":
		return true
	}
	return false
}

// Code is the response's HTTP status code, 0 when the log has none (a watch still open).
func (e Event) Code() int {
	if e.ResponseStatus == nil {
		return 0
	}
	return e.ResponseStatus.Code
}

// Failed tells whether the API server answered with an error (4xx or 5xx).
func (e Event) Failed() bool { return e.Code() >= 400 }

// Read reads every request in the audit log at path, one event per request in the order
// they were first logged: the one of its last stage written so far (a watch that is still
// open has only ResponseStarted).
func Read(path string) ([]Event, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	defer f.Close()
	byID := map[string]int{}
	var out []Event
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var e Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			return nil, fmt.Errorf("audit: log line %q: %w", sc.Text(), err)
		}
		if i, ok := byID[e.AuditID]; ok {
			out[i] = e
			continue
		}
		byID[e.AuditID] = len(out)
		out = append(out, e)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("audit: reading %s: %w", path, err)
	}
	return out, nil
}

// UpTo returns the audit log at path once it holds every request received before UpTo was
// called: it sends a marker request (GET /version as the admin: client must be the admin's,
// and the policy must log it, see MarkerRule) and waits up to a minute until the marker is
// in the log.
func UpTo(ctx context.Context, client kubernetes.Interface, path string) ([]Event, error) {
	raw := make([]byte, 8)
	if _, err := rand.Read(raw); err != nil {
		return nil, fmt.Errorf("audit: marker: %w", err)
	}
	id := hex.EncodeToString(raw)
	if _, err := client.Discovery().RESTClient().Get().AbsPath("/version").Param("audit-marker", id).DoRaw(ctx); err != nil {
		return nil, fmt.Errorf("audit: sending the marker: %w", err)
	}
	var events []Event
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		var err error
		if events, err = Read(path); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return false, nil
			}
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
		return nil, fmt.Errorf("audit: waiting for marker %s in %s: %w", id, path, err)
	}
	return events, nil
}
