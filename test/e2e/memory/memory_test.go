package memory

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstream"
)

// shortPairs is the test's data set: 250 claims, PVs and VolumeAttachments, 500 Pods
// (a few seconds to create; every process fills its caches through the cache transform).
const shortPairs = 250

// Each of our processes, alone and combined, leads and gets ready on a small steady data
// set, resyncs, and leaves it alone: no call that changes a volume, no write to a claim,
// PV or VolumeAttachment.
func TestEachOfOurProcessesLeadsOnSteadyData(t *testing.T) {
	ctx := context.Background()
	s := e2e.NewScenario(t, kube.Get(t), binDir, testdriver.Config{})
	d, err := newDataset(ctx, s, shortPairs)
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	if err := d.grow(ctx, shortPairs); err != nil {
		t.Fatal(err)
	}
	t.Logf("data set: %d claims, PVs and VolumeAttachments, %d Pods in %v", shortPairs, 2*shortPairs, time.Since(began).Round(time.Millisecond))
	before := d.versions(t)

	const resync = 2 * time.Second
	var procs []*process
	for _, sc := range ourSidecars(resync) {
		procs = append(procs, start(t, s, sc, sc.name))
	}
	checkSteady(t, s, procs, resync, "volumes")
	for name, rv := range d.versions(t) {
		if before[name] != rv {
			t.Errorf("%s was written by a sidecar (resourceVersion %s -> %s)", name, before[name], rv)
		}
	}
}

// versions maps each claim, PV and VolumeAttachment of the data set to its resourceVersion.
func (d *dataset) versions(t testing.TB) map[string]string {
	t.Helper()
	ctx := context.Background()
	sel := metav1.ListOptions{LabelSelector: runLabel + "=" + d.s.Namespace}
	out := map[string]string{}
	pvcs, err := d.kube.CoreV1().PersistentVolumeClaims(d.s.Namespace).List(ctx, sel)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range pvcs.Items {
		out["PVC "+o.Name] = o.ResourceVersion
	}
	pvs, err := d.kube.CoreV1().PersistentVolumes().List(ctx, sel)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range pvs.Items {
		out["PV "+o.Name] = o.ResourceVersion
	}
	vas, err := d.kube.StorageV1().VolumeAttachments().List(ctx, sel)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range vas.Items {
		out["VolumeAttachment "+o.Name] = o.ResourceVersion
	}
	return out
}

// measurement is one process's memory on one data set size.
type measurement struct {
	memory
	work int // calls that changed a volume (expected: none)
}

// BenchmarkMemory measures, on -memory.pairs claims (and half as many first), the peak RSS
// of each of our sidecars, of our combined process and of upstream's sidecars. Each process
// runs until it leads (ours: and /readyz says its caches are synced), then one resync
// period and a margin; then its VmHWM is read. Ours and upstream's of one sidecar run side by
// side, so they see the same load; the combined process runs alone.
func BenchmarkMemory(b *testing.B) {
	for range b.N {
		benchmarkMemory(b)
	}
}

func benchmarkMemory(b *testing.B) {
	ctx := context.Background()
	full := *flagPairs
	sizes := []int{full / 2, full}
	resync, margin := *flagResync, *flagMargin

	upstreamBins := upstreamPaths(upstream.Releases())

	s := e2e.NewScenario(b, kube.Get(b), binDir, testdriver.Config{})
	d, err := newDataset(ctx, s, full)
	if err != nil {
		b.Fatal(err)
	}
	results := map[int]map[string]measurement{} // size -> label -> measurement
	setup := map[int]time.Duration{}
	for _, size := range sizes {
		began := time.Now()
		from := d.pairs
		if err := d.grow(ctx, size); err != nil {
			b.Fatal(err)
		}
		setup[size] = time.Since(began)
		say("data set %d -> %d claims: %d objects created (%d API requests, QPS %d) in %v", from, size,
			objects(size-from), 10*(size-from), setupQPS, setup[size].Round(100*time.Millisecond))
		results[size] = map[string]measurement{}
		ours := ourSidecars(resync)
		var groups [][]sidecar
		for _, sc := range ours[:3] {
			if !selected(sc.name) {
				continue
			}
			group := []sidecar{sc}
			if bin, ok := upstreamBins[sc.name]; ok {
				group = append(group, upstreamSidecar(sc.name, bin, resync))
			}
			groups = append(groups, group)
		}
		if selected(ours[3].name) {
			groups = append(groups, []sidecar{ours[3]})
		}
		for _, group := range groups {
			for label, m := range measureGroup(b, s, group, size, resync+margin) {
				results[size][label] = m
			}
		}
	}
	if size, err := d.podJSONSize(ctx); err == nil {
		say("one Pod of the data set: %d bytes as JSON", size)
	}
	report(b, sizes, results, setup, resync, margin)
}

// upstreamPaths are the binaries of releases TestMain built, by sidecar; a line says why
// for each that is missing.
func upstreamPaths(releases []upstream.Release) map[string]string {
	out := map[string]string{}
	switch {
	case !*flagUpstream:
		say("upstream: not measured (-memory.upstream=false)")
	case upstreamBinaries == nil:
		say("upstream: not measured: %v", errNotPrepared)
	default:
		for _, u := range releases {
			switch ub, ok := upstreamBinaries[u.Sidecar]; {
			case !ok:
				say("upstream %s: not measured: TestMain did not build %s", u.Sidecar, u)
			case ub.Err != nil:
				say("upstream %s: not measured: %v", u.Sidecar, ub.Err)
			default:
				out[u.Sidecar] = ub.Path
			}
		}
	}
	return out
}

// selected says whether -memory.only names sidecar (or is empty).
func selected(sidecar string) bool {
	return *flagOnly == "" || slices.Contains(strings.Split(*flagOnly, ","), sidecar)
}

// measureGroup runs the group's processes side by side on the data set, each until it
// leads and is ready, then settle; and returns their memory by label.
func measureGroup(b *testing.B, s *e2e.Scenario, group []sidecar, size int, settle time.Duration) map[string]measurement {
	var procs []*process
	for _, sc := range group {
		id := fmt.Sprintf("%s-%s-%d", map[bool]string{true: "ours", false: "up"}[sc.ours], sc.name, size)
		var extra []string
		if sc.ours && *flagHeapProfiles != "" {
			extra = append(extra, "--enable-pprof")
		}
		procs = append(procs, start(b, s, sc, id, extra...))
	}
	began := time.Now()
	errs := make([]error, len(procs))
	ready := make([]time.Duration, len(procs))
	var wg sync.WaitGroup
	for i, p := range procs {
		wg.Go(func() {
			errs[i] = p.waitLeading(s, 5*time.Minute)
			ready[i] = time.Since(began)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		b.Fatal(err)
	}
	time.Sleep(settle)
	calls := s.Driver.Journal()
	out := map[string]measurement{}
	for i, p := range procs {
		if !p.running() {
			b.Fatalf("%s exited\n%s", p.label(), p.logTail())
		}
		m := measurement{memory: p.memory(), work: p.workCalls(calls)}
		out[p.label()] = m
		say("N = %d  %-24s led (ours: and ready) after %5.1fs, peak RSS %6.1f MiB, RSS now %6.1f MiB (anonymous %.1f, file %.1f)",
			size, p.label(), ready[i].Seconds(), mib(m.peak), mib(m.now), mib(m.anon), mib(m.file))
		if p.ours && *flagHeapProfiles != "" {
			writeHeapProfile(b, p)
		}
		p.stop()
	}
	return out
}

func writeHeapProfile(b *testing.B, p *process) {
	code, body := p.get("/debug/pprof/heap?gc=1") // after a GC: in use now, not at the last GC
	if code != http.StatusOK {
		say("heap profile of %s: HTTP %d", p.label(), code)
		return
	}
	if err := os.MkdirAll(*flagHeapProfiles, 0o755); err != nil {
		b.Logf("heap profile: %v", err)
		return
	}
	path := filepath.Join(*flagHeapProfiles, p.id+".pb.gz")
	if err := os.WriteFile(path, body, 0o644); err != nil {
		b.Logf("heap profile: %v", err)
		return
	}
	say("heap profile of %s: %s", p.label(), path)
	// The text form ends with the runtime's memory statistics (heap, stacks, GC metadata).
	if code, body := p.get("/debug/pprof/heap?debug=1"); code == http.StatusOK {
		if err := os.WriteFile(filepath.Join(*flagHeapProfiles, p.id+".txt"), body, 0o644); err != nil {
			b.Logf("heap profile: %v", err)
		}
	}
}

// report logs the tables and reports the full size's figures as metrics.
func report(b *testing.B, sizes []int, results map[int]map[string]measurement, setup map[int]time.Duration, resync, margin time.Duration) {
	var out strings.Builder
	names := []string{"attacher", "provisioner", "resizer"}
	ours := func(size int, name string) (measurement, bool) {
		m, ok := results[size]["csi-sidecars "+name]
		return m, ok
	}
	up := func(size int, name string) (measurement, bool) {
		m, ok := results[size]["upstream "+name]
		return m, ok
	}
	upSum := func(size int) (int64, bool) {
		var sum int64
		for _, n := range names {
			m, ok := up(size, n)
			if !ok {
				return 0, false
			}
			sum += m.peak
		}
		return sum, true
	}
	fmt.Fprintf(&out, "\nPeak RSS (VmHWM), read once each process leads (ours: and is ready) plus one resync (%v) and %v.\n", resync, margin)
	fmt.Fprintf(&out, "Upstream: %s, run side by side with ours; the combined process runs alone.\n", upstream.Names())
	fmt.Fprintf(&out, "Each size holds N claims (PVC+PV), N VolumeAttachments, 2N Pods: 5N objects.\n")
	for _, size := range sizes {
		var setupTotal time.Duration
		for _, z := range sizes {
			if z <= size {
				setupTotal += setup[z]
			}
		}
		fmt.Fprintf(&out, "\nN = %d (%d objects; set up in %v in all)\n", size, objects(size), setupTotal.Round(100*time.Millisecond))
		tw := tabwriter.NewWriter(&out, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "sidecar\tcsi-sidecars MiB\tupstream MiB\tours/upstream\tours RSS at end\tupstream RSS at end\twork calls (ours/upstream)\t")
		for _, n := range names {
			o, _ := ours(size, n)
			if u, ok := up(size, n); ok {
				fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.2f\t%.1f\t%.1f\t%d/%d\t\n", n, mib(o.peak), mib(u.peak), float64(o.peak)/float64(u.peak), mib(o.now), mib(u.now), o.work, u.work)
			} else {
				fmt.Fprintf(tw, "%s\t%.1f\t-\t-\t%.1f\t-\t%d/-\t\n", n, mib(o.peak), mib(o.now), o.work)
			}
		}
		c, _ := ours(size, "combined")
		var oursSum int64
		for _, n := range names {
			o, _ := ours(size, n)
			oursSum += o.peak
		}
		if sum, ok := upSum(size); ok {
			fmt.Fprintf(tw, "combined vs sum of 3 upstream\t%.1f\t%.1f\t%.2f\t%.1f\t-\t%d/-\t\n", mib(c.peak), mib(sum), float64(c.peak)/float64(sum), mib(c.now), c.work)
		} else {
			fmt.Fprintf(tw, "combined\t%.1f\t-\t-\t%.1f\t-\t%d/-\t\n", mib(c.peak), mib(c.now), c.work)
		}
		fmt.Fprintf(tw, "(sum of our 3 alone)\t%.1f\t\t\t\t\t\t\n", mib(oursSum))
		tw.Flush()
	}

	// Growth between the two sizes, per 1,000 objects of the mix.
	small, large := sizes[0], sizes[len(sizes)-1]
	per1k := float64(objects(large)-objects(small)) / 1000
	slope := func(a, z measurement) float64 { return mib(z.peak-a.peak) / per1k }
	fmt.Fprintf(&out, "\nGrowth of the peak from N = %d to %d, MiB per 1,000 objects (mix 1 PVC : 1 PV : 1 VA : 2 Pods)\n", small, large)
	tw := tabwriter.NewWriter(&out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "sidecar\tcsi-sidecars\tupstream\t")
	for _, n := range append(names, "combined") {
		o0, _ := ours(small, n)
		o1, _ := ours(large, n)
		line := fmt.Sprintf("%s\t%.2f\t", n, slope(o0, o1))
		u0, ok0 := up(small, n)
		u1, ok1 := up(large, n)
		switch {
		case ok0 && ok1:
			line += fmt.Sprintf("%.2f\t", slope(u0, u1))
		case n == "combined":
			s0, ok0 := upSum(small)
			s1, ok1 := upSum(large)
			if ok0 && ok1 {
				line += fmt.Sprintf("%.2f (sum of 3)\t", mib(s1-s0)/per1k)
			} else {
				line += "-\t"
			}
		default:
			line += "-\t"
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
	// On stdout: go test keeps only 10 lines of a benchmark's log.
	fmt.Print(out.String())

	// Metrics: the full size's peaks and ratios, and the growth.
	b.ReportMetric(setup[small].Seconds()+setup[large].Seconds(), "setup-s")
	for _, n := range names {
		o, _ := ours(large, n)
		b.ReportMetric(mib(o.peak), n+"-ours-MiB")
		o0, _ := ours(small, n)
		b.ReportMetric(slope(o0, o), n+"-ours-MiB/1k-objects")
		if u, ok := up(large, n); ok {
			b.ReportMetric(mib(u.peak), n+"-upstream-MiB")
			b.ReportMetric(float64(o.peak)/float64(u.peak), n+"-ours/upstream")
			if u0, ok := up(small, n); ok {
				b.ReportMetric(slope(u0, u), n+"-upstream-MiB/1k-objects")
			}
		}
	}
	c, _ := ours(large, "combined")
	c0, _ := ours(small, "combined")
	b.ReportMetric(mib(c.peak), "combined-MiB")
	b.ReportMetric(slope(c0, c), "combined-MiB/1k-objects")
	if sum, ok := upSum(large); ok {
		b.ReportMetric(mib(sum), "upstream-sum-MiB")
		b.ReportMetric(float64(c.peak)/float64(sum), "combined/upstream-sum")
	}
}

// say prints a line of progress on stdout, which go test shows as it comes (a benchmark's
// log is shown only at its end, and only 10 lines of it).
func say(format string, args ...any) {
	fmt.Printf("memory: "+format+"\n", args...)
}

// checkSteady waits until every process leads and a resync (resync) has passed, then fails
// t for a process that exited or made driver calls that change what (nothing needs
// doing on steady data), and logs each one's memory.
func checkSteady(t *testing.T, s *e2e.Scenario, procs []*process, resync time.Duration, what string) {
	t.Helper()
	for _, p := range procs {
		if err := p.waitLeading(s, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(resync + time.Second) // the resync must pass: nothing else says it did
	calls := s.Driver.Journal()
	for _, p := range procs {
		if !p.running() {
			t.Errorf("%s exited after leading\n%s", p.label(), p.logTail())
			continue
		}
		if n := p.workCalls(calls); n != 0 {
			t.Errorf("%s made %d calls that change %s on steady data", p.label(), n, what)
		}
		m := p.memory()
		t.Logf("%-24s peak RSS %.1f MiB, RSS %.1f MiB (anonymous %.1f, file %.1f)", p.label(), mib(m.peak), mib(m.now), mib(m.anon), mib(m.file))
	}
}
