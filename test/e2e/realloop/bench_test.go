package realloop

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cluster"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstream"
)

const (
	// benchNodes is how many fake nodes a benchmark world has.
	benchNodes = 4
	// stall is how long a benchmark waits for the next Pod to reach a stage before it
	// counts the Pods still waiting as stuck: long enough for a retry after a few
	// backoffs (retry-interval-start 1 s, doubling), and for a noisy machine.
	stall = 90 * time.Second
	// lifeStageTimeout bounds a life run's wait for each stage of one Pod.
	lifeStageTimeout = 3 * time.Minute
)

// BenchmarkRealControlLoop runs the same workload under the real control loop (4 fake
// nodes, a driver whose calls take 20 ms) with csi-sidecars' three sidecars and then with
// upstream's (upstream.Releases), each at its default flags (--kube-api-qps=5,
// --kube-api-burst=10), in a world of its own, and prints them side by side:
//
//   - life: -realloop.life-pods Pods, one every -realloop.life-interval, each with a new
//     WaitForFirstConsumer claim: the scheduler picks a node, the provisioner provisions,
//     kube-controller-manager binds and attaches; every third claim is grown and every
//     third (others) given a new VolumeAttributesClass; each Pod is deleted
//     -realloop.in-use after its volume is attached and then its claim. Per stage p50/p99
//     latency and throughput.
//   - goodput: for -realloop.stream, a new Pod with a new claim every interval of
//     -realloop.intervals (by default 1200, 600 and 300 ms: half, about all and twice the
//     provisionings QPS 5 allows at upstream's 3 writes each); the claims bound per second
//     (over the time from the first Pod's creation to the last claim bound) and p99 creation
//     to bound. The Pods and claims are deleted once every volume is attached.
//   - after each run settled: claims never bound, Pods whose volume was not deleted, and
//     claims, PersistentVolumes, VolumeAttachments and driver volumes left.
//   - API writes per operation, from the API server's audit log over all runs: per sidecar
//     (told apart by the request's user agent) and operation (provision, delete, attach,
//     detach, expand, modify: by the object written and whether the claim or Pod was
//     deleted, grown or modified then), events included, Lease renewals not; failed writes
//     (409, 404, 429) too.
//
// Figures are printed (stdout), never asserted. It takes about 17 minutes on a shared 2-core
// machine.
func BenchmarkRealControlLoop(b *testing.B) {
	if noLoop != nil {
		b.Skipf("no real control loop: %v", noLoop)
	}
	intervals, err := parseIntervals(*flagIntervals)
	if err != nil {
		b.Fatal(err)
	}
	impls := []implementation{ours}
	if up, why := upstreamImplementation(); why != "" {
		say("upstream: not measured: %s", why)
	} else {
		impls = append(impls, up)
	}
	results := map[string]*measurement{}
	for _, im := range impls {
		b.Run(im.name, func(b *testing.B) {
			for range b.N {
				m := measure(b, im, intervals)
				results[im.name] = m
				m.report(b)
			}
		})
	}
	if len(results) > 0 {
		fmt.Print(formatResults(impls, results, intervals))
	}
}

// upstreamImplementation is upstream's sidecars, or why there are none.
func upstreamImplementation() (implementation, string) {
	switch {
	case !*flagUpstream:
		return implementation{}, "-realloop.upstream=false"
	case upstreamBinaries == nil:
		return implementation{}, "upstream's binaries are built only when benchmarks run (-bench), not -short"
	}
	im := implementation{name: "upstream", binaries: map[string]string{}}
	var why []string
	for _, r := range upstream.Releases() {
		bin := upstreamBinaries[r.Sidecar]
		if bin.Err != nil {
			why = append(why, strings.TrimPrefix(bin.Err.Error(), "upstream: "))
			continue
		}
		im.binaries[r.Sidecar] = bin.Path
	}
	if len(why) > 0 {
		return implementation{}, strings.Join(why, "; ")
	}
	return im, ""
}

func parseIntervals(list string) ([]time.Duration, error) {
	var out []time.Duration
	for f := range strings.SplitSeq(list, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		d, err := time.ParseDuration(f)
		if err != nil || d <= 0 {
			return nil, fmt.Errorf("-realloop.intervals: %q is no positive duration", f)
		}
		out = append(out, d)
	}
	return out, nil
}

// say prints a line of progress on stdout, which go test shows as it comes (a benchmark's
// log is shown only at its end).
func say(format string, args ...any) {
	fmt.Printf("realloop: "+format+"\n", args...)
}

// measurement is what one implementation's world measured.
type measurement struct {
	life    runResult
	streams []runResult
	writes  writeCounts
	took    time.Duration
}

// runResult is one run of Pods: its spans, its goodput and what was left after it.
type runResult struct {
	name     string
	interval time.Duration
	pods     int
	summary  []cluster.SpanSummary
	// bound is how many claims were bound, boundPerSecond their rate from the first Pod's
	// creation to the last claim bound, p99Bound the 99th percentile of creation to bound.
	bound          int
	boundPerSecond float64
	p99Bound       time.Duration
	left           leftovers
	took           time.Duration
	items          []cluster.Item
}

// leftovers is what a run left behind once it settled.
type leftovers struct {
	unbound, stuck                 int // claims never bound; Pods whose volume was not deleted
	claims, pvs, vas, volumes, pod int // objects left: the run's claims and Pods, the driver's PVs, VolumeAttachments and volumes
}

func (l leftovers) String() string {
	return fmt.Sprintf("%d/%d/%d/%d", l.claims, l.pvs, l.vas, l.volumes)
}

// measure runs the life run and the goodput runs in one new world of im.
func measure(b *testing.B, im implementation, intervals []time.Duration) *measurement {
	began := time.Now()
	w := newWorld(b, benchNodes, im)
	say("%s: world up in %v; life run: %d Pods, one every %v", im.name, time.Since(began).Round(time.Second), *flagLifePods, *flagLifeInterval)
	m := &measurement{}
	from := time.Now()
	m.life = w.lifeRun("life", *flagLifePods, *flagLifeInterval, *flagInUse)
	say("%s: life run took %v, left %s", im.name, m.life.took.Round(time.Second), m.life.left)
	items := m.life.items
	for i, every := range intervals {
		r := w.goodputRun(fmt.Sprintf("g%d", i), every, *flagStream)
		say("%s: goodput at a Pod every %v: %d Pods, %.2f claims bound per second, p99 creation to bound %v; took %v, left %s",
			im.name, every, r.pods, r.boundPerSecond, r.p99Bound.Round(time.Millisecond), r.took.Round(time.Second), r.left)
		m.streams = append(m.streams, r)
		items = append(items, r.items...)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	events, err := audit.UpTo(ctx, w.Client, auditLog)
	if err != nil {
		b.Fatal(err)
	}
	m.writes = countWrites(events, from, time.Now(), attribution{impl: im, namespace: w.Namespace, driver: w.Driver.DriverName(), items: items})
	m.took = time.Since(began)
	for _, r := range []*e2e.Replica{w.provisioner, w.attacher, w.resizer} {
		if !r.Running() {
			b.Errorf("%s %s exited during the benchmark with %d", im.name, r.Name, r.ExitCode)
		}
	}
	if err := w.cluster.Running(); err != nil {
		b.Error(err)
	}
	return m
}

// report gives the benchmark framework the main figures.
func (m *measurement) report(b *testing.B) {
	for _, r := range m.life.summary {
		name := strings.ReplaceAll(r.Span.Name, " ", "-")
		b.ReportMetric(r.P50.Seconds(), name+"-p50-s")
		b.ReportMetric(r.P99.Seconds(), name+"-p99-s")
	}
	for _, r := range m.streams {
		b.ReportMetric(r.boundPerSecond, fmt.Sprintf("bound/s-at-%v", r.interval))
	}
	for _, k := range opOrder {
		if c := m.writes[k]; c != nil && c.Ops > 0 {
			b.ReportMetric(c.PerOp(), k.sidecar+"-"+k.op+"-writes/op")
		}
	}
}

// newWorkload is a workload of the world's namespace with a StorageClass and a
// VolumeAttributesClass of its own.
func (w *world) newWorkload(name string) *cluster.Workload {
	w.T.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	work, err := cluster.NewWorkload(ctx, w.Client, cluster.WorkloadOptions{Namespace: w.Namespace, Driver: w.Driver.DriverName(), Class: w.Namespace + "-" + name,
		AttributesClass: w.Namespace + "-" + name + "-fast", AttributesParameters: fastParameters()})
	if err != nil {
		w.T.Fatal(err)
	}
	w.T.Cleanup(work.Close)
	return work
}

// pace calls create(i) in a goroutine of its own for i in [0, n), the i-th at start +
// i*every, whatever the earlier calls take; it returns when every call has returned.
func pace(n int, every time.Duration, create func(i int)) {
	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		// Offered load at a fixed rate: the time of a creation is the workload's, not
		// a wait for something to happen.
		time.Sleep(time.Until(start.Add(time.Duration(i) * every)))
		wg.Go(func() { create(i) })
	}
	wg.Wait()
}

// lifeRun takes n Pods through their life, a new one every `every`: created with a new
// claim, its volume attached, every third claim grown and every third given a new
// VolumeAttributesClass (lifeChangeOf), the Pod deleted inUse after its volume was
// attached (and changed), then the claim. A Pod stuck at a stage is deleted anyway, with
// its claim, and counted in the leftovers.
func (w *world) lifeRun(name string, n int, every, inUse time.Duration) runResult {
	began := time.Now()
	work := w.newWorkload(name)
	names := podNames(name, n)
	pace(n, every, func(i int) { w.life(work, names[i], lifeChangeOf(i), inUse) })
	r := w.settle(work, name, names)
	r.interval, r.took = every, time.Since(began)
	return r
}

// lifeChange is what a Pod's life changes of its claim while the Pod uses it.
type lifeChange int

const (
	keep   lifeChange = iota
	grow              // its request raised to 2Gi: ControllerExpandVolume
	modify            // its VolumeAttributesClass set to the workload's: ControllerModifyVolume
)

// lifeChangeOf is the change of the i-th Pod's claim: every third grown, the next one
// modified, the third kept. No claim is both, so that the resizer's writes of each tell
// which operation they are.
func lifeChangeOf(i int) lifeChange {
	switch i % 3 {
	case 0:
		return grow
	case 1:
		return modify
	}
	return keep
}

// life is one Pod's life in lifeRun; a stage not reached in lifeStageTimeout ends it
// early (the Pod and claim are still deleted).
func (w *world) life(work *cluster.Workload, name string, change lifeChange, inUse time.Duration) {
	ctx := context.Background()
	waitFor := func(stage cluster.Stage) bool {
		wctx, cancel := context.WithTimeout(ctx, lifeStageTimeout)
		defer cancel()
		return work.Wait(wctx, stage, name) == nil
	}
	if err := work.CreatePod(ctx, name); err != nil {
		w.T.Errorf("life of %s: %v", name, err)
		return
	}
	attached := waitFor(cluster.Attached)
	if attached {
		it, _ := work.Item(name)
		at := it.Times[cluster.Attached]
		switch change {
		case grow:
			if err := work.Grow(ctx, name, "2Gi"); err != nil {
				w.T.Errorf("life of %s: %v", name, err)
			} else {
				waitFor(cluster.Grown)
			}
		case modify:
			if err := work.Modify(ctx, name, work.AttributesClass()); err != nil {
				w.T.Errorf("life of %s: %v", name, err)
			} else {
				waitFor(cluster.Modified)
			}
		}
		// The Pod uses its volume for inUse: the workload's think time.
		time.Sleep(time.Until(at.Add(inUse)))
	}
	if err := work.DeletePod(ctx, name); err != nil {
		w.T.Errorf("life of %s: %v", name, err)
		return
	}
	if attached {
		waitFor(cluster.Detached) // a volume never attached is never detached
	}
	if err := work.DeleteClaim(ctx, name); err != nil {
		w.T.Errorf("life of %s: %v", name, err)
	}
}

// goodputRun offers a new Pod with a new claim every `every` for `length`, waits until
// the claims are bound and the volumes attached, and then deletes the Pods and the claims.
func (w *world) goodputRun(name string, every, length time.Duration) runResult {
	began := time.Now()
	work := w.newWorkload(name)
	names := podNames(name, int(length/every))
	ctx := context.Background()
	pace(len(names), every, func(i int) {
		if err := work.CreatePod(ctx, names[i]); err != nil {
			w.T.Errorf("goodput run %s: %v", name, err)
		}
	})
	waitAll(work, cluster.Bound, names)
	waitAll(work, cluster.Attached, names)
	for _, n := range names {
		if err := work.DeletePod(ctx, n); err != nil {
			w.T.Errorf("goodput run %s: %v", name, err)
		}
	}
	waitAll(work, cluster.Detached, names)
	for _, n := range names {
		if err := work.DeleteClaim(ctx, n); err != nil {
			w.T.Errorf("goodput run %s: %v", name, err)
		}
	}
	r := w.settle(work, name, names)
	r.interval, r.took = every, time.Since(began)
	return r
}

func podNames(prefix string, n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("%s-%03d", prefix, i)
	}
	return names
}

// waitAll waits until every named Pod reached stage, as long as one more reaches it at
// least every `stall`; it returns the Pods still waiting then.
func waitAll(work *cluster.Workload, stage cluster.Stage, names []string) []string {
	left := names
	for len(left) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), stall)
		err := work.Wait(ctx, stage, left...)
		cancel()
		if err == nil {
			return nil
		}
		still := notReached(work, stage, left)
		if len(still) == len(left) {
			return still
		}
		left = still
	}
	return nil
}

func notReached(work *cluster.Workload, stage cluster.Stage, names []string) []string {
	var out []string
	for _, n := range names {
		if it, ok := work.Item(n); !ok || it.Times[stage].IsZero() {
			out = append(out, n)
		}
	}
	return out
}

// settle waits until every volume of the run is deleted (or no more are for `stall`) and
// takes the run's figures and leftovers.
func (w *world) settle(work *cluster.Workload, name string, names []string) runResult {
	ctx := context.Background()
	created := work.Names()
	stuck := waitAll(work, cluster.VolumeDeleted, created)
	r := runResult{name: name, pods: len(names), summary: work.Summary()}
	r.left.stuck = len(stuck)
	r.left.unbound = len(notReached(work, cluster.Bound, created))
	var first, last time.Time
	var toBound []time.Duration
	for _, n := range created {
		it, _ := work.Item(n)
		r.items = append(r.items, it)
		c, bound := it.Times[cluster.PodCreated], it.Times[cluster.Bound]
		if first.IsZero() || c.Before(first) {
			first = c
		}
		if bound.IsZero() {
			continue
		}
		r.bound++
		toBound = append(toBound, bound.Sub(c))
		if bound.After(last) {
			last = bound
		}
	}
	if d := last.Sub(first); r.bound > 0 && d > 0 {
		r.boundPerSecond = float64(r.bound) / d.Seconds()
	}
	r.p99Bound = cluster.Percentile(toBound, 99)

	ours := map[string]bool{}
	for _, n := range created {
		ours[n] = true
	}
	if claims, err := w.Client.CoreV1().PersistentVolumeClaims(w.Namespace).List(ctx, metav1.ListOptions{}); err == nil {
		for _, c := range claims.Items {
			if ours[c.Name] {
				r.left.claims++
			}
		}
	} else {
		w.T.Errorf("listing claims: %v", err)
	}
	if pods, err := w.Client.CoreV1().Pods(w.Namespace).List(ctx, metav1.ListOptions{}); err == nil {
		for _, p := range pods.Items {
			if ours[p.Name] {
				r.left.pod++
			}
		}
	} else {
		w.T.Errorf("listing Pods: %v", err)
	}
	driver := w.Driver.DriverName()
	if pvs, err := w.Client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{}); err == nil {
		for _, pv := range pvs.Items {
			if pv.Spec.CSI != nil && pv.Spec.CSI.Driver == driver {
				r.left.pvs++
			}
		}
	} else {
		w.T.Errorf("listing PersistentVolumes: %v", err)
	}
	if vas, err := w.Client.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{}); err == nil {
		for _, va := range vas.Items {
			if va.Spec.Attacher == driver {
				r.left.vas++
			}
		}
	} else {
		w.T.Errorf("listing VolumeAttachments: %v", err)
	}
	r.left.volumes = len(w.Driver.Volumes())
	if len(stuck) > 0 {
		w.T.Logf("%s run %s: %d Pods stuck:\n%s", w.impl.name, name, len(stuck), describeStuck(work, stuck))
	}
	return r
}

// describeStuck says which stages the stuck Pods reached.
func describeStuck(work *cluster.Workload, names []string) string {
	var b strings.Builder
	for i, n := range names {
		if i == 10 {
			fmt.Fprintf(&b, "  ... and %d more\n", len(names)-i)
			break
		}
		it, _ := work.Item(n)
		var reached []string
		for _, s := range cluster.Stages() {
			if !it.Times[s].IsZero() {
				reached = append(reached, string(s))
			}
		}
		fmt.Fprintf(&b, "  %s: %s\n", n, strings.Join(reached, " "))
	}
	return b.String()
}

// commit names the source tree the binaries were built from.
func commit() string {
	out, err := exec.Command("git", "-C", "../../..", "describe", "--always", "--dirty", "--abbrev=12").Output()
	if err != nil {
		return "unknown commit"
	}
	return "commit " + strings.TrimSpace(string(out))
}

// formatResults is the side-by-side table of every implementation measured.
func formatResults(impls []implementation, results map[string]*measurement, intervals []time.Duration) string {
	var measured []implementation
	for _, im := range impls {
		if results[im.name] != nil {
			measured = append(measured, im)
		}
	}
	var b strings.Builder
	names := []string{"csi-sidecars (" + commit() + ")"}
	if len(measured) > 1 {
		names = append(names, "upstream ("+upstream.Names()+")")
	}
	fmt.Fprintf(&b, "\nREAL CONTROL LOOP, %s, default flags (--kube-api-qps=5 --kube-api-burst=10), %d fake nodes, driver calls of 20 ms\n",
		strings.Join(names, " vs "), benchNodes)

	fmt.Fprintf(&b, "\nlife: %d Pods, one every %v, each with a new WaitForFirstConsumer claim, deleted %v after its volume is attached (every third claim grown first, every third modified), then the claim\n",
		*flagLifePods, *flagLifeInterval, *flagInUse)
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	head := "span\tfrom -> to"
	for _, im := range measured {
		head += fmt.Sprintf("\t%s n\tp50\tp99\tper s", im.name)
	}
	fmt.Fprintln(tw, head+"\t")
	for _, span := range cluster.DefaultSpans() {
		from := make([]string, len(span.From))
		for i, s := range span.From {
			from[i] = string(s)
		}
		line := span.Name + "\t" + strings.Join(from, "+") + " -> " + string(span.To)
		for _, im := range measured {
			r, ok := findSpan(results[im.name].life.summary, span.Name)
			if !ok {
				line += "\t-\t-\t-\t-"
				continue
			}
			line += fmt.Sprintf("\t%d\t%v\t%v\t%.2f", r.N, r.P50.Round(10*time.Millisecond), r.P99.Round(10*time.Millisecond), r.PerSecond)
		}
		fmt.Fprintln(tw, line+"\t")
	}
	tw.Flush()

	fmt.Fprintf(&b, "\ngoodput: a new Pod with a new claim at a fixed rate for %v; claims bound per second from the first Pod's creation to the last claim bound, p99 of creation to bound\n", *flagStream)
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	head = "offered\tPods"
	for _, im := range measured {
		head += fmt.Sprintf("\t%s bound/s\tp99 create->bound\tbound", im.name)
	}
	fmt.Fprintln(tw, head+"\t")
	for i, every := range intervals {
		line := fmt.Sprintf("%.2f/s (every %v)", 1/every.Seconds(), every)
		pods := 0
		cols := ""
		for _, im := range measured {
			if i >= len(results[im.name].streams) {
				cols += "\t-\t-\t-"
				continue
			}
			r := results[im.name].streams[i]
			pods = r.pods
			cols += fmt.Sprintf("\t%.2f\t%v\t%d", r.boundPerSecond, r.p99Bound.Round(10*time.Millisecond), r.bound)
		}
		fmt.Fprintln(tw, fmt.Sprintf("%s\t%d", line, pods)+cols+"\t")
	}
	tw.Flush()

	b.WriteString("\nafter settling, per run (stuck: Pods whose volume was not deleted; left: claims/PVs/VolumeAttachments/driver volumes)\n")
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	head = "run"
	for _, im := range measured {
		head += fmt.Sprintf("\t%s unbound\tstuck\tleft\ttook", im.name)
	}
	fmt.Fprintln(tw, head+"\t")
	runs := []string{"life"}
	for _, every := range intervals {
		runs = append(runs, fmt.Sprintf("goodput every %v", every))
	}
	for i, run := range runs {
		line := run
		for _, im := range measured {
			m := results[im.name]
			all := append([]runResult{m.life}, m.streams...)
			if i >= len(all) {
				line += "\t-\t-\t-\t-"
				continue
			}
			r := all[i]
			line += fmt.Sprintf("\t%d\t%d\t%s\t%v", r.left.unbound, r.left.stuck, r.left, r.took.Round(time.Second))
		}
		fmt.Fprintln(tw, line+"\t")
	}
	tw.Flush()

	b.WriteString("\nAPI writes per operation, from the audit log over all runs (events included, Lease renewals not); failed: answered 409/404/429\n")
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	head = "sidecar\toperation"
	for _, im := range measured {
		head += fmt.Sprintf("\t%s ops\twrites/op\tfailed/op (409/404/429)", im.name)
	}
	fmt.Fprintln(tw, head+"\t")
	for _, k := range opOrder {
		line := k.sidecar + "\t" + k.op
		for _, im := range measured {
			c := results[im.name].writes[k]
			if c == nil {
				line += "\t0\t-\t-"
				continue
			}
			line += fmt.Sprintf("\t%d\t%s\t%s", c.Ops, c.PerOpString(), c.FailedString())
		}
		fmt.Fprintln(tw, line+"\t")
	}
	tw.Flush()
	for _, im := range measured {
		fmt.Fprintf(&b, "%s, writes by kind (per operation):\n", im.name)
		for _, k := range opOrder {
			if c := results[im.name].writes[k]; c != nil && c.Writes > 0 {
				fmt.Fprintf(&b, "  %s %s: %s\n", k.sidecar, k.op, c.Kinds())
			}
		}
		for _, k := range results[im.name].writes.others() {
			c := results[im.name].writes[k]
			fmt.Fprintf(&b, "  %s, not of one of the runs' volumes: %d writes: %s\n", k.sidecar, c.Writes, c.Kinds())
		}
	}
	return b.String()
}

func findSpan(rows []cluster.SpanSummary, name string) (cluster.SpanSummary, bool) {
	for _, r := range rows {
		if r.Span.Name == name {
			return r, true
		}
	}
	return cluster.SpanSummary{}, false
}
