package realloop

import (
	"bufio"
	"fmt"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// requestLogFlags make our replicas log, besides their usual lines, each API request's
// answer with its time (client-go's round_trippers at -v=6) and each wait of more than
// 50 ms for a token of the client's budget (request.go at -v=3), for the timeline of a long
// stall: which process wrote what, and how long it waited in its rate limiter first.
// --vmodule raises only those two files' level; every other line stays at -v=2.
var requestLogFlags = []string{"--vmodule=request=3,round_trippers=6"}

// procLine is one line of a replica's log that a timeline shows.
type procLine struct {
	at   time.Time
	proc string
	// kind: "request" (an API request answered: its verb, path, status and time on the
	// wire), "throttled" (a wait for a token that ended at `at`), "lifecycle" (the core's
	// drain, Lease and leading messages).
	kind               string
	verb, path, status string
	took               time.Duration // the request's time on the wire, or the wait for its token
	text               string
}

// start is when the line's request was sent, or its wait for a token began.
func (l procLine) start() time.Time { return l.at.Add(-l.took) }

func (l procLine) String() string {
	switch l.kind {
	case "request":
		return fmt.Sprintf("%s: %s %s %s (%v on the wire)", l.proc, l.verb, l.path, l.status, l.took.Round(time.Millisecond))
	case "throttled":
		return fmt.Sprintf("%s: %s %s sent after %v in the client's rate limiter", l.proc, l.verb, l.path, l.took.Round(time.Millisecond))
	}
	return l.proc + ": " + l.text
}

// klogHeader is the header of a line of klog's text format: severity, date, time, thread
// id, file and line.
var klogHeader = regexp.MustCompile(`^([IWEF])(\d{4} \d{2}:\d{2}:\d{2}\.\d{6})\s+\d+ ([^:\s]+):\d+\] (.*)$`)

// lifecycleMessages begin the core's lines a timeline shows.
var lifecycleMessages = []string{
	`"Stopping`, `"Drained`, `"Released the Lease`, `"Leaving the Lease`, `"Acquired the Lease`,
	`"Leading: starting work`, `"Fenced`, `"Standby stopping`, `"Sidecar did not return`, `"Starting provisioning`,
}

// parseProcLog reads the lines of one replica's log that a timeline shows. Dates in klog's
// header have no year: that of now is taken (tests do not run over New Year).
func parseProcLog(proc, log string, now time.Time) []procLine {
	var out []procLine
	sc := bufio.NewScanner(strings.NewReader(log))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		m := klogHeader.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		at, err := time.ParseInLocation("0102 15:04:05.000000", m[2], time.Local)
		if err != nil {
			continue
		}
		at = at.AddDate(now.Year(), 0, 0)
		file, msg := m[3], m[4]
		l := procLine{at: at, proc: proc}
		switch {
		case file == "round_trippers.go" && strings.HasPrefix(msg, `"Response"`):
			kv := keyValues(msg)
			ms, _ := strconv.Atoi(kv["milliseconds"])
			l.kind, l.verb, l.path, l.status, l.took = "request", kv["verb"], shortPath(kv["url"]), kv["status"], time.Duration(ms)*time.Millisecond
			if strings.Contains(kv["url"], "watch=true") {
				continue // a watch's end says nothing of a write
			}
		case file == "request.go" && strings.HasPrefix(msg, `"Waited before sending request"`):
			kv := keyValues(msg)
			d, _ := time.ParseDuration(kv["delay"])
			l.kind, l.verb, l.path, l.took = "throttled", kv["verb"], shortPath(kv["URL"]), d
		default:
			keep := false
			for _, prefix := range lifecycleMessages {
				keep = keep || strings.HasPrefix(msg, prefix)
			}
			if !keep {
				continue
			}
			l.kind, l.text = "lifecycle", msg
		}
		out = append(out, l)
	}
	return out
}

// keyValue is one key="value" or key=value pair of a structured log line.
var keyValue = regexp.MustCompile(`(\w+)=("(?:[^"\\]|\\.)*"|\S+)`)

func keyValues(msg string) map[string]string {
	out := map[string]string{}
	for _, m := range keyValue.FindAllStringSubmatch(msg, -1) {
		v := m[2]
		if uq, err := strconv.Unquote(v); err == nil {
			v = uq
		}
		out[m[1]] = v
	}
	return out
}

// shortPath is a request URL's path without the API prefix, namespace and query:
// persistentvolumeclaims/roll-003/status, leases/external-attacher-leader-x.
func shortPath(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return raw
	}
	p := u.Path
	for _, prefix := range []string{"/api/v1/", "/apis/"} {
		p = strings.TrimPrefix(p, prefix)
	}
	parts := strings.Split(p, "/")
	// group/version/... for named groups
	if len(parts) > 2 && strings.Contains(parts[0], ".") {
		parts = parts[2:]
	}
	if len(parts) > 2 && parts[0] == "namespaces" {
		parts = parts[2:]
	}
	return strings.Join(parts, "/")
}
