// Package memory measures the resident memory of csi-sidecars' sidecars, alone and
// combined in one process, on a realistic steady cluster against a real kube-apiserver:
// bound claims with their PersistentVolumes, attached VolumeAttachments and Running Pods
// using the claims, which the sidecars list, watch and resync without anything to do.
// BenchmarkMemory (make bench) compares each with upstream's release on the same data, and
// prints per sidecar the peak RSS (VmHWM) after the caches are synced and one resync has
// passed, ours vs upstream, the combined process vs the sum of upstream's three, and the
// growth per 1,000 objects. BenchmarkMemorySnapshots adds ready VolumeSnapshotContents and
// their classes (the snapshot CRDs of v8.7.0) and compares our snapshotter with upstream's
// csi-snapshotter (peak and anonymous RSS, growth per 1,000 contents), then each of the
// four sidecars and the combined process of the four vs the sum of upstream's four on the
// whole data set. Figures are printed, never asserted. The tests check, on a small data
// set, that each of our processes gets ready and leads and leaves the steady data alone.
//
// Upstream's binaries are built by TestMain from their tagged modules on the Go module proxy
// (internal/testkit/upstream) and cached in ~/.cache/csi-sidecars/upstream/<repo>-<tag>/; when a
// build fails, the benchmark says so and reports ours only.
//
// BenchmarkMemory takes 7-8 minutes on 2 cores with the defaults (two sizes, four rounds of
// one resync plus a margin each), BenchmarkMemorySnapshots about 7 (six rounds) and 1-2 more
// for the clean-up of its data, close to go test's default -timeout of 10 minutes: make
// bench passes -timeout 60m; pass -timeout 30m to run one alone. A quick look: -args
// -memory.pairs=200 -memory.snapshots=400 -memory.resync=5s, or -memory.only=snapshotter
// (a hundred claims only, as the contents' source volumes).
package memory

import (
	"errors"
	"flag"
	"os"
	"testing"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstream"
)

var (
	kube   controlplane.Shared
	binDir string

	flagPairs        = flag.Int("memory.pairs", 2500, "benchmark size: claims (each with a PV and a VolumeAttachment) and two Pods per claim; the benchmark also measures half of it for the growth per 1,000 objects")
	flagResync       = flag.Duration("memory.resync", 30*time.Second, "resync period given to the sidecars (attacher --resync, resizer --resync-period); memory is read one resync plus -memory.margin after each leads and is ready")
	flagMargin       = flag.Duration("memory.margin", 10*time.Second, "wait after the resync period before reading the memory")
	flagUpstream     = flag.Bool("memory.upstream", true, "build and measure upstream's sidecars too (benchmark only)")
	flagSnapshots    = flag.Int("memory.snapshots", 5000, "BenchmarkMemorySnapshots: ready VolumeSnapshotContents (two per claim with the default -memory.pairs); the snapshotters are also measured on half of it for the growth per 1,000 contents")
	flagOnly         = flag.String("memory.only", "", "measure only these of attacher, provisioner, resizer, snapshotter, combined (comma-separated; default all; in BenchmarkMemory combined is the three, in BenchmarkMemorySnapshots the four)")
	flagOurEnv       = flag.String("memory.our-env", "", "extra environment of our processes, comma-separated NAME=value (for experiments, e.g. GOGC=50)")
	flagHeapProfiles = flag.String("memory.heap-profiles", "", "a folder: write a heap profile of each of our processes there before it is stopped (runs them with --enable-pprof)")
)

// upstreamBinaries are upstream's binaries by sidecar, built by TestMain before the tests
// start (so a first build does not count against the test timeout); nil when benchmarks do
// not run.
var upstreamBinaries map[string]upstream.Binary

var errNotPrepared = errors.New("upstream binaries are built only when benchmarks run (-bench) with -memory.upstream")

func TestMain(m *testing.M) {
	flag.Parse()
	// Building upstream's releases takes minutes the first time: do it before the tests
	// start, so it does not count against -timeout, and only when benchmarks run.
	if bench := flag.Lookup("test.bench"); bench != nil && bench.Value.String() != "" && *flagUpstream && !testing.Short() &&
		os.Getenv(controlplane.SkipEnv) != "1" {
		upstreamBinaries = upstream.BuildReleases(upstream.AllReleases(), os.Stderr)
	}
	os.Exit(e2e.Main(m, "../../..", &kube, &binDir))
}
