package snapshotter

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstream"
)

var (
	flagWritesSnapshots = flag.Int("snapshotter.writes-snapshots", 20, "BenchmarkSnapshotWrites: VolumeSnapshots per run")
	flagWritesEvery     = flag.Duration("snapshotter.writes-every", 500*time.Millisecond, "BenchmarkSnapshotWrites: a VolumeSnapshot created, and later deleted, this often")
)

var (
	// auditLog is the API server's audit log (auditPolicy), kept only when benchmarks run.
	auditLog string
	// upstreamSnapshotter is upstream's csi-snapshotter, built (or found cached) before
	// benchmarks run; its Err says why there is none.
	upstreamSnapshotter = upstream.Binary{Release: upstream.Snapshotter(), Err: errNoBenchmark}
)

var errNoBenchmark = errors.New("upstream's csi-snapshotter is built only when benchmarks run")

// auditPolicy logs every write and every GET of core and snapshot objects at Metadata
// level, events' writes with their body (whose involved object tells which content they are
// about), and the marker audit.UpTo sends.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
` + audit.MarkerRule + audit.WriteRules + `- level: Metadata
  verbs: ["get"]
  resources:
  - group: ""
  - group: "snapshot.storage.k8s.io"
- level: None
`

// benchSetup prepares what only benchmarks need, when they run with a control plane: the
// audit log's kube-apiserver flags, and upstream's csi-snapshotter (a first build takes
// minutes; it is cached after). cleanup removes the audit log's folder.
func benchSetup() (opts controlplane.Options, cleanup func(), err error) {
	cleanup = func() {}
	if !e2e.Benchmarks() || testing.Short() || os.Getenv(controlplane.SkipEnv) == "1" {
		return opts, cleanup, nil
	}
	dir, err := os.MkdirTemp("", "csi-sidecars-snapshotter-audit-")
	if err != nil {
		return opts, cleanup, fmt.Errorf("audit log folder: %w", err)
	}
	cleanup = func() { os.RemoveAll(dir) }
	args, log, err := audit.Setup(dir, auditPolicy)
	if err != nil {
		cleanup()
		return opts, func() {}, err
	}
	auditLog = log
	upstreamSnapshotter = upstream.BuildReleases([]upstream.Release{upstream.Snapshotter()}, os.Stderr)["snapshotter"]
	return controlplane.Options{APIServerArgs: args}, cleanup, nil
}

// Operations of the snapshotter whose writes BenchmarkSnapshotWrites counts, in the order
// of its table; a write about no VolumeSnapshot of the run is counted under opOther.
const (
	opTakeReady  = "take a snapshot, ready at the first answer"
	opTakePolled = "take a snapshot, ready at the 3rd CreateSnapshot"
	opDelete     = "delete a snapshot"
	opOther      = "other (about no VolumeSnapshot of the run)"
)

var writeOps = []string{opTakeReady, opTakePolled, opDelete}

// writesRun is one run of BenchmarkSnapshotWrites: a sidecar, a driver whose snapshots are
// ready after polls answers saying not ready, and the operation its snapshots are taken by.
type writesRun struct {
	upstream bool
	polls    int
	take     string
}

func (w writesRun) impl() string {
	if w.upstream {
		return "upstream"
	}
	return "ours"
}

// writes tells whether the request is one of the run's sidecar: ours writes with
// csi-sidecars/snapshotter and its events with the process's shared client (csi-sidecars);
// upstream's with client-go's default user agent, which begins with the binary's name.
func (w writesRun) writes(e audit.Event) bool {
	if w.upstream {
		return strings.HasPrefix(e.UserAgent, upstreamSnapshotter.Cmd+"/")
	}
	return e.UserAgent == "csi-sidecars" || strings.HasPrefix(e.UserAgent, "csi-sidecars/")
}

// writesResult is what a run counted: tallies by operation, and the driver's calls.
type writesResult struct {
	tallies               map[string]*audit.Tally
	createCalls, delCalls int
	leaked                int
	took                  time.Duration
}

// BenchmarkSnapshotWrites counts the API requests of the snapshotter per operation, ours
// (`csi-sidecars snapshotter`) and upstream's csi-snapshotter v8.7.0 side by side, from the
// API server's audit log: every write (events included, Lease writes not) and every GET of
// the sidecar's process, told apart by user agent, and the failed writes (409, 404, 429).
//
// Each implementation runs twice at its default flags (5 QPS, burst 10; retries from 1 s)
// beside the real snapshot-controller, on -snapshotter.writes-snapshots claims: once with
// snapshots the driver says are ready at once, once with snapshots it says are not ready in
// its first two answers (ready at the third CreateSnapshot). A VolumeSnapshot of each claim is
// created every -snapshotter.writes-every; once all are ready (and no content is left being
// created) they are deleted at the same pace (class deletionPolicy Delete), until their
// contents are gone. A write about a VolumeSnapshot (its content, or an event about either)
// takes the snapshot when it comes before the VolumeSnapshot's deletion, deletes it after.
// Figures are printed, never asserted.
func BenchmarkSnapshotWrites(b *testing.B) {
	if auditLog == "" {
		b.Skip("no audit log: benchmarks run with a control plane only")
	}
	for range b.N {
		results := map[string]map[string]*audit.Tally{} // implementation -> operation
		calls := map[string]string{}
		impls := []bool{false}
		if upstreamSnapshotter.Err == nil {
			impls = append(impls, true)
		}
		for _, up := range impls {
			for _, run := range []writesRun{{upstream: up, take: opTakeReady}, {upstream: up, polls: 2, take: opTakePolled}} {
				r := newRepeat(b)
				res := measureWrites(r, run)
				r.done()
				fmt.Printf("snapshotter writes: %s, %s: %d VolumeSnapshots taken and deleted in %v, %d CreateSnapshot and %d DeleteSnapshot calls, %d leaked\n",
					run.impl(), run.take, *flagWritesSnapshots, res.took.Round(100*time.Millisecond), res.createCalls, res.delCalls, res.leaked)
				if results[run.impl()] == nil {
					results[run.impl()] = map[string]*audit.Tally{}
				}
				merge(results[run.impl()], res.tallies)
				calls[run.impl()+run.take] = fmt.Sprintf("%.2f", float64(res.createCalls)/float64(*flagWritesSnapshots))
			}
		}
		fmt.Print(writesTable(results, calls))
		for impl, byOp := range results {
			for i, op := range writeOps {
				if c := byOp[op]; c != nil && c.Ops > 0 {
					b.ReportMetric(c.PerOp(), fmt.Sprintf("%s-%s-writes/op", impl, []string{"take", "take-polled", "delete"}[i]))
				}
			}
		}
		if upstreamSnapshotter.Err != nil {
			b.Skipf("upstream's half not measured: %v", upstreamSnapshotter.Err)
		}
	}
}

// merge adds the tallies of from to into.
func merge(into, from map[string]*audit.Tally) {
	for op, c := range from {
		t := into[op]
		if t == nil {
			t = audit.NewTally()
			into[op] = t
		}
		t.Ops += c.Ops
		t.Writes += c.Writes
		t.Gets += c.Gets
		for code, n := range c.Failed {
			t.Failed[code] += n
		}
		for k, n := range c.ByKind {
			t.ByKind[k] += n
		}
	}
}

// measureWrites runs run's sidecar on its own scenario and counts its requests.
func measureWrites(t testing.TB, run writesRun) writesResult {
	began := time.Now()
	n, every := *flagWritesSnapshots, *flagWritesEvery
	s := newScenario(t, testdriver.Config{SnapshotReadyAfterPolls: run.polls})
	claims := s.claims(n)
	from := time.Now()
	if run.upstream {
		s.StartUpstream("upstream", upstreamSnapshotter.Path)
	} else {
		s.Start("ours", []string{"csi-sidecars", "snapshotter"})
	}

	names := make([]string, n)
	paced := func(do func(i int)) {
		start := time.Now()
		for i := range n {
			time.Sleep(time.Until(start.Add(time.Duration(i) * every)))
			do(i)
		}
	}
	paced(func(i int) {
		names[i] = fmt.Sprintf("snap-%02d", i)
		s.snapshot(names[i], claims[i])
	})
	s.waitReady(names...)
	// The take ends with the being-created annotation's removal, after the status: wait for
	// it, and a quiet moment, so that no write of a take comes after the deletion.
	s.WaitUntil("no content being created", func() bool {
		for _, c := range s.contents() {
			if _, ok := c.Annotations["snapshot.storage.kubernetes.io/volumesnapshot-being-created"]; ok {
				return false
			}
		}
		return true
	})
	time.Sleep(2 * time.Second)

	contentOf := map[string]string{} // content -> VolumeSnapshot
	for name, vs := range s.volumeSnapshots() {
		if vs.Status != nil && vs.Status.BoundVolumeSnapshotContentName != nil {
			contentOf[*vs.Status.BoundVolumeSnapshotContentName] = name
		}
	}
	deleted := map[string]time.Time{} // VolumeSnapshot -> its deletion requested
	paced(func(i int) {
		deleted[names[i]] = time.Now()
		s.deleteSnapshot(names[i])
	})
	s.WaitUntil("every VolumeSnapshot and content gone", func() bool {
		return len(s.volumeSnapshots()) == 0 && len(s.contents()) == 0
	})
	// Writes that come late (a retry answered 404) count too.
	time.Sleep(2 * time.Second)
	to := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	events, err := audit.UpTo(ctx, s.Client, auditLog)
	if err != nil {
		t.Fatal(err)
	}
	res := writesResult{
		tallies:     countSnapshotWrites(events, from, to, run, s.Namespace, contentOf, deleted),
		createCalls: len(s.Driver.Calls(testdriver.MethodCreateSnapshot)),
		delCalls:    len(s.Driver.Calls(testdriver.MethodDeleteSnapshot)),
		leaked:      len(s.Driver.Snapshots()),
		took:        time.Since(began),
	}
	res.tallies[run.take].Ops += n
	res.tallies[opDelete].Ops += n
	return res
}

// countSnapshotWrites counts the writes and GETs of run's sidecar received in [from, to),
// Lease writes left out, by operation: a request about a VolumeSnapshot of the run (its
// content, or an event about either) is run.take before the VolumeSnapshot's deletion was
// requested (deleted), opDelete after; any other one is opOther (an event: opOther with the
// kind of the event's object). contentOf maps the contents to their VolumeSnapshots, which
// are in namespace.
func countSnapshotWrites(events []audit.Event, from, to time.Time, run writesRun, namespace string, contentOf map[string]string, deleted map[string]time.Time) map[string]*audit.Tally {
	out := map[string]*audit.Tally{run.take: audit.NewTally(), opDelete: audit.NewTally()}
	bodies := audit.EventBodies{}
	for _, e := range events {
		if !e.IsWrite() && e.Verb != "get" || e.Resource() == "leases" {
			continue
		}
		var body *audit.EventBody
		if e.IsWrite() && strings.HasPrefix(e.Resource(), "events") {
			body = bodies.Of(e)
		}
		if e.RequestReceived.Before(from) || !e.RequestReceived.Before(to) || !run.writes(e) {
			continue
		}
		kind, ns, name := "", e.Namespace(), e.Name()
		switch res := e.Resource(); {
		case body != nil:
			o := body.Object()
			kind, ns, name = o.Kind, o.Namespace, o.Name
		case strings.HasPrefix(res, "volumesnapshotcontents"):
			kind = "VolumeSnapshotContent"
		case strings.HasPrefix(res, "volumesnapshots"):
			kind = "VolumeSnapshot"
		}
		snapshot := ""
		switch {
		case kind == "VolumeSnapshotContent":
			snapshot = contentOf[name]
		case kind == "VolumeSnapshot" && ns == namespace:
			snapshot = name
		}
		op := opOther
		if body != nil && snapshot == "" {
			// Say what the events are about: a startup's, a Lease's.
			op = opOther + ", events about a " + kind
		}
		if at, ok := deleted[snapshot]; ok {
			op = run.take
			if !e.RequestReceived.Before(at) {
				op = opDelete
			}
		}
		if out[op] == nil {
			out[op] = audit.NewTally()
		}
		out[op].Add(e)
	}
	return out
}

// writesTable prints the writes per operation side by side, then by kind; calls are the
// CreateSnapshot calls per take by implementation and operation.
func writesTable(results map[string]map[string]*audit.Tally, calls map[string]string) string {
	var b strings.Builder
	impls := []string{"upstream", "ours"}
	fmt.Fprintf(&b, "\nSnapshotter API writes per operation, from the audit log (events included, Lease writes not); upstream: %s\n", upstreamSnapshotter.Release)
	fmt.Fprintf(&b, "failed: answered 409/404/429; GETs: of core and snapshot objects\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "operation\tops\tupstream writes/op\tours writes/op\tupstream failed/op\tours failed/op\tupstream GETs/op\tours GETs/op\tCreateSnapshot calls/op (upstream/ours)\t")
	cell := func(impl, op string, f func(*audit.Tally) string) string {
		if c := results[impl][op]; c != nil {
			return f(c)
		}
		return "-"
	}
	for _, op := range writeOps {
		ops := 0
		if c := results["ours"][op]; c != nil {
			ops = c.Ops
		}
		callsOf := func(impl string) string {
			if v, ok := calls[impl+op]; ok {
				return v
			}
			return "-"
		}
		createCalls := "\t"
		if op != opDelete {
			createCalls = callsOf("upstream") + "/" + callsOf("ours") + "\t"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", op, ops,
			cell("upstream", op, (*audit.Tally).PerOpString), cell("ours", op, (*audit.Tally).PerOpString),
			cell("upstream", op, (*audit.Tally).FailedString), cell("ours", op, (*audit.Tally).FailedString),
			cell("upstream", op, func(c *audit.Tally) string { return c.PerOpOf(c.Gets) }),
			cell("ours", op, func(c *audit.Tally) string { return c.PerOpOf(c.Gets) }), createCalls)
	}
	tw.Flush()
	for _, impl := range impls {
		if results[impl] == nil {
			continue
		}
		fmt.Fprintf(&b, "%s, writes by kind (per operation):\n", impl)
		ops := append([]string{}, writeOps...)
		for _, op := range slices.Sorted(maps.Keys(results[impl])) {
			if !slices.Contains(writeOps, op) {
				ops = append(ops, op)
			}
		}
		for _, op := range ops {
			if c := results[impl][op]; c != nil && c.Writes > 0 {
				fmt.Fprintf(&b, "  %s: %s\n", op, c.Kinds())
			}
		}
		if c := results[impl][opOther]; c != nil && c.Gets > 0 {
			fmt.Fprintf(&b, "  %s: %d GETs in all\n", opOther, c.Gets)
		}
	}
	return b.String()
}
