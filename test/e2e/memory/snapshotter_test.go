package memory

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstream"
)

// Targets of issue 20, printed beside the figures (never asserted): the snapshotter's
// anonymous memory at most 0.6 of upstream's csi-snapshotter's, the combined process of the
// four at most 0.25 of the sum of the four upstream sidecars' peaks.
const (
	targetSnapshotterAnon = 0.6
	targetCombinedPeak    = 0.25
)

// Our snapshotter and the combined process of all four lead and get ready on steady
// snapshot data (ready contents, classes) beside the claims', resync, and make no call
// that changes a snapshot or volume and write no content.
func TestOurSnapshotterAndTheFourCombinedLeadOnSteadySnapshots(t *testing.T) {
	const claims, contents = 50, 200
	ctx := context.Background()
	s := e2e.NewScenario(t, kube.Get(t), binDir, snapshotDriver())
	d, err := newDataset(ctx, s, claims)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.grow(ctx, claims); err != nil {
		t.Fatal(err)
	}
	sd, err := newSnapshotData(ctx, d)
	if err != nil {
		t.Fatal(err)
	}
	if err := sd.grow(ctx, contents); err != nil {
		t.Fatal(err)
	}
	before, err := sd.versions(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(before) != contents {
		t.Fatalf("%d contents listed, want %d", len(before), contents)
	}
	claimsBefore := d.versions(t)

	const resync = 2 * time.Second
	snap, combined := ourSnapshotterSidecars(resync)
	procs := []*process{start(t, s, snap, "snapshotter"), start(t, s, combined, "combined4")}
	checkSteady(t, s, procs, resync, "snapshots or volumes")
	if n, err := sd.written(ctx, before); err != nil {
		t.Fatal(err)
	} else if n != 0 {
		t.Errorf("%d VolumeSnapshotContents written by a sidecar", n)
	}
	for name, rv := range d.versions(t) {
		if claimsBefore[name] != rv {
			t.Errorf("%s was written by a sidecar (resourceVersion %s -> %s)", name, claimsBefore[name], rv)
		}
	}
}

// snapMeasurement is one process's memory in a group, with the contents the group wrote.
type snapMeasurement struct {
	measurement
	contentWrites int // contents written while the group ran (expected: none)
}

// BenchmarkMemorySnapshots measures the snapshotter, ours (`csi-sidecars snapshotter`) and
// upstream's csi-snapshotter side by side, on -memory.snapshots ready VolumeSnapshotContents
// of the driver in three VolumeSnapshotClasses (and on half as many first, for the growth
// per 1,000 contents); then, on the whole data set (-memory.pairs claims with their PVs,
// VolumeAttachments and Pods, and the contents), each of the other three sidecars beside
// upstream's, and the combined process of the four (--controllers=attacher,provisioner,
// resizer,snapshotter) alone. It prints, per sidecar, the peak RSS (VmHWM) and the anonymous
// RSS (RssAnon: heap, stacks, runtime; not the binary's pages) read once each process leads
// (ours: and is ready) plus one resync and -memory.margin; the snapshotter's anonymous memory
// vs upstream's and the combined peak vs the sum of upstream's four peaks, beside their
// targets.
func BenchmarkMemorySnapshots(b *testing.B) {
	for range b.N {
		benchmarkMemorySnapshots(b)
	}
}

func benchmarkMemorySnapshots(b *testing.B) {
	ctx := context.Background()
	full := *flagSnapshots
	sizes := []int{full / 2, full}
	resync, margin := *flagResync, *flagMargin
	upstreamBins := upstreamPaths(upstream.AllReleases())
	ours := ourSidecars(resync)[:3]
	ourSnap, ourCombined := ourSnapshotterSidecars(resync)
	others := []sidecar{}
	for _, sc := range ours {
		if selected(sc.name) {
			others = append(others, sc)
		}
	}
	// The claims are the contents' source volumes; without another sidecar to measure on
	// them, a few are enough.
	pairs := *flagPairs
	if len(others) == 0 && !selected("combined") {
		pairs = min(pairs, 100)
	}

	s := e2e.NewScenario(b, kube.Get(b), binDir, snapshotDriver())
	d, err := newDataset(ctx, s, pairs)
	if err != nil {
		b.Fatal(err)
	}
	began := time.Now()
	if err := d.grow(ctx, pairs); err != nil {
		b.Fatal(err)
	}
	setup := time.Since(began)
	say("data set: %d claims: %d objects created in %v", pairs, objects(pairs), setup.Round(100*time.Millisecond))
	sd, err := newSnapshotData(ctx, d)
	if err != nil {
		b.Fatal(err)
	}

	// measure runs a group and counts the contents written meanwhile.
	measure := func(group []sidecar, size int) map[string]snapMeasurement {
		before, err := sd.versions(ctx)
		if err != nil {
			b.Fatal(err)
		}
		ms := measureGroup(b, s, group, size, resync+margin)
		written, err := sd.written(ctx, before)
		if err != nil {
			b.Fatal(err)
		}
		out := map[string]snapMeasurement{}
		for label, m := range ms {
			out[label] = snapMeasurement{measurement: m, contentWrites: written}
		}
		return out
	}

	bySize := map[int]map[string]snapMeasurement{} // contents -> label -> measurement
	for _, size := range sizes {
		began := time.Now()
		from := sd.contents
		if err := sd.grow(ctx, size); err != nil {
			b.Fatal(err)
		}
		setup += time.Since(began)
		say("snapshots %d -> %d: %d snapshots cut and VolumeSnapshotContents created ready in %v", from, size, size-from, time.Since(began).Round(100*time.Millisecond))
		if !selected(ourSnap.name) {
			continue
		}
		group := []sidecar{ourSnap}
		if bin, ok := upstreamBins[ourSnap.name]; ok {
			group = append(group, upstreamSidecar(ourSnap.name, bin, resync))
		}
		bySize[size] = measure(group, size)
	}
	// The whole data set: the snapshotters' figures at the full size, the other three
	// beside upstream's, the combined process alone.
	whole := map[string]snapMeasurement{}
	for label, m := range bySize[full] {
		whole[label] = m
	}
	for _, sc := range others {
		group := []sidecar{sc}
		if bin, ok := upstreamBins[sc.name]; ok {
			group = append(group, upstreamSidecar(sc.name, bin, resync))
		}
		for label, m := range measure(group, pairs) {
			whole[label] = m
		}
	}
	if selected("combined") {
		for label, m := range measure([]sidecar{ourCombined}, pairs) {
			whole[label] = m
		}
	}
	if size, err := sd.contentJSONSize(ctx); err == nil {
		say("one VolumeSnapshotContent of the data set: %d bytes as JSON", size)
	}
	reportSnapshots(b, sizes, pairs, bySize, whole, setup, resync, margin)
}

// reportSnapshots prints BenchmarkMemorySnapshots' tables and reports the full size's
// figures as metrics.
func reportSnapshots(b *testing.B, sizes []int, pairs int, bySize map[int]map[string]snapMeasurement, whole map[string]snapMeasurement, setup, resync, margin time.Duration) {
	var out strings.Builder
	names := []string{"attacher", "provisioner", "resizer", "snapshotter"}
	ratio := func(a, b int64) float64 { return float64(a) / float64(b) }
	verdict := func(r, target float64) string {
		if r <= target {
			return fmt.Sprintf("met (<= %.2f)", target)
		}
		return fmt.Sprintf("MISSED (> %.2f)", target)
	}
	fmt.Fprintf(&out, "\nMemory read once each process leads (ours: and is ready) plus one resync (%v) and %v:\n", resync, margin)
	fmt.Fprintf(&out, "peak RSS (VmHWM) and anonymous RSS (RssAnon: heap, stacks, runtime; not the binary's pages).\n")
	fmt.Fprintf(&out, "Upstream: %s, run side by side with ours; the combined process runs alone.\n", upstream.NamesOf(upstream.AllReleases()))

	full := sizes[len(sizes)-1]
	fmt.Fprintf(&out, "\nSNAPSHOTTER on N ready VolumeSnapshotContents of the driver (%d VolumeSnapshotClasses), beside %d claims (PVC, PV, VolumeAttachment, 2 Pods each)\n", len(snapshotClasses), pairs)
	tw := tabwriter.NewWriter(&out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "N contents\tours peak MiB\tupstream peak MiB\tpeak ours/upstream\tours anon MiB\tupstream anon MiB\tanon ours/upstream\twork calls (ours/upstream)\tcontents written\t")
	for _, size := range sizes {
		o, ok := bySize[size]["csi-sidecars snapshotter"]
		if !ok {
			continue
		}
		if u, ok := bySize[size]["upstream snapshotter"]; ok {
			fmt.Fprintf(tw, "%d\t%.1f\t%.1f\t%.2f\t%.1f\t%.1f\t%.2f\t%d/%d\t%d\t\n", size, mib(o.peak), mib(u.peak), ratio(o.peak, u.peak),
				mib(o.anon), mib(u.anon), ratio(o.anon, u.anon), o.work, u.work, o.contentWrites)
		} else {
			fmt.Fprintf(tw, "%d\t%.1f\t-\t-\t%.1f\t-\t-\t%d/-\t%d\t\n", size, mib(o.peak), mib(o.anon), o.work, o.contentWrites)
		}
	}
	tw.Flush()
	small := sizes[0]
	per1k := float64(full-small) / 1000
	slope := func(label string, f func(memory) int64) (float64, bool) {
		a, ok0 := bySize[small][label]
		z, ok1 := bySize[full][label]
		return mib(f(z.memory)-f(a.memory)) / per1k, ok0 && ok1
	}
	peakOf := func(m memory) int64 { return m.peak }
	anonOf := func(m memory) int64 { return m.anon }
	fmt.Fprintf(&out, "Growth from N = %d to %d, MiB per 1,000 contents:", small, full)
	for _, label := range []string{"csi-sidecars snapshotter", "upstream snapshotter"} {
		p, ok := slope(label, peakOf)
		a, _ := slope(label, anonOf)
		if ok {
			fmt.Fprintf(&out, " %s peak %.2f, anon %.2f;", label, p, a)
		}
	}
	fmt.Fprintln(&out)
	if o, ok := bySize[full]["csi-sidecars snapshotter"]; ok {
		if u, ok := bySize[full]["upstream snapshotter"]; ok {
			r := ratio(o.anon, u.anon)
			fmt.Fprintf(&out, "Target, snapshotter anonymous memory vs upstream at N = %d: %.3f, %s\n", full, r, verdict(r, targetSnapshotterAnon))
		}
	}

	fmt.Fprintf(&out, "\nALL FOUR on the whole data set: %d claims (%d objects) and %d contents\n", pairs, objects(pairs), full)
	tw = tabwriter.NewWriter(&out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "sidecar\tours peak MiB\tupstream peak MiB\tpeak ours/upstream\tours anon MiB\tupstream anon MiB\tanon ours/upstream\twork calls (ours/upstream)\t")
	var oursPeak, oursAnon, upPeak, upAnon int64
	upAll, oursAll := true, true
	for _, n := range names {
		o, ok := whole["csi-sidecars "+n]
		if !ok {
			upAll, oursAll = false, false
			continue
		}
		oursPeak += o.peak
		oursAnon += o.anon
		u, ok := whole["upstream "+n]
		if !ok {
			upAll = false
			fmt.Fprintf(tw, "%s\t%.1f\t-\t-\t%.1f\t-\t-\t%d/-\t\n", n, mib(o.peak), mib(o.anon), o.work)
			continue
		}
		upPeak += u.peak
		upAnon += u.anon
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.2f\t%.1f\t%.1f\t%.2f\t%d/%d\t\n", n, mib(o.peak), mib(u.peak), ratio(o.peak, u.peak),
			mib(o.anon), mib(u.anon), ratio(o.anon, u.anon), o.work, u.work)
	}
	c, combined := whole["csi-sidecars combined"]
	if combined {
		if upAll {
			fmt.Fprintf(tw, "combined of 4 vs sum of 4 upstream\t%.1f\t%.1f\t%.2f\t%.1f\t%.1f\t%.2f\t%d/-\t\n", mib(c.peak), mib(upPeak), ratio(c.peak, upPeak),
				mib(c.anon), mib(upAnon), ratio(c.anon, upAnon), c.work)
		} else {
			fmt.Fprintf(tw, "combined of 4\t%.1f\t-\t-\t%.1f\t-\t-\t%d/-\t\n", mib(c.peak), mib(c.anon), c.work)
		}
	}
	if oursAll {
		fmt.Fprintf(tw, "(sum of our 4 alone)\t%.1f\t\t\t%.1f\t\t\t\t\n", mib(oursPeak), mib(oursAnon))
	}
	tw.Flush()
	if combined && upAll {
		r := ratio(c.peak, upPeak)
		fmt.Fprintf(&out, "Target, combined peak RSS vs the sum of upstream's four: %.3f, %s\n", r, verdict(r, targetCombinedPeak))
	}
	fmt.Print(out.String())

	b.ReportMetric(setup.Seconds(), "setup-s")
	if o, ok := bySize[full]["csi-sidecars snapshotter"]; ok {
		b.ReportMetric(mib(o.peak), "snapshotter-ours-MiB")
		b.ReportMetric(mib(o.anon), "snapshotter-ours-anon-MiB")
		if p, ok := slope("csi-sidecars snapshotter", peakOf); ok {
			b.ReportMetric(p, "snapshotter-ours-MiB/1k-contents")
		}
		if u, ok := bySize[full]["upstream snapshotter"]; ok {
			b.ReportMetric(mib(u.peak), "snapshotter-upstream-MiB")
			b.ReportMetric(mib(u.anon), "snapshotter-upstream-anon-MiB")
			b.ReportMetric(ratio(o.peak, u.peak), "snapshotter-ours/upstream")
			b.ReportMetric(ratio(o.anon, u.anon), "snapshotter-anon-ours/upstream")
			if p, ok := slope("upstream snapshotter", peakOf); ok {
				b.ReportMetric(p, "snapshotter-upstream-MiB/1k-contents")
			}
		}
	}
	if combined {
		b.ReportMetric(mib(c.peak), "combined4-MiB")
		if upAll {
			b.ReportMetric(mib(upPeak), "upstream-sum4-MiB")
			b.ReportMetric(ratio(c.peak, upPeak), "combined4/upstream-sum4")
		}
	}
}
