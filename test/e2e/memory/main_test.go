// Package memory measures the resident memory of csi-sidecars' sidecars, alone and
// combined in one process, on a realistic steady cluster against a real kube-apiserver:
// bound claims with their PersistentVolumes, attached VolumeAttachments and Running Pods
// using the claims, which the sidecars list, watch and resync without anything to do.
// BenchmarkMemory (make bench) compares each with upstream's release on the same data, and
// prints per sidecar the peak RSS (VmHWM) after the caches are synced and one resync has
// passed, ours vs upstream, the combined process vs the sum of upstream's three, and the
// growth per 1,000 objects. Figures are printed, never asserted. The test checks, on a
// small data set, that each of our processes gets ready and leads and leaves the steady
// data alone.
//
// Upstream's binaries are built by TestMain from their repositories' tags (git mirrors,
// -memory.mirrors) and cached in ~/.cache/csi-sidecars/upstream/<repo>-<tag>/; without a
// mirror, or when a build fails, the benchmark says so and reports ours only.
//
// The benchmark takes 7-8 minutes on 2 cores with the defaults (two sizes, four rounds of
// one resync plus a margin each), close to go test's default -timeout of 10 minutes:
// make bench passes -timeout 60m. A quick look: -args -memory.pairs=200 -memory.resync=5s.
package memory

import (
	"errors"
	"flag"
	"os"
	"testing"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/upstream"
)

var (
	kube   controlplane.Shared
	binDir string

	flagPairs        = flag.Int("memory.pairs", 2500, "benchmark size: claims (each with a PV and a VolumeAttachment) and two Pods per claim; the benchmark also measures half of it for the growth per 1,000 objects")
	flagResync       = flag.Duration("memory.resync", 30*time.Second, "resync period given to the sidecars (attacher --resync, resizer --resync-period); memory is read one resync plus -memory.margin after each leads and is ready")
	flagMargin       = flag.Duration("memory.margin", 10*time.Second, "wait after the resync period before reading the memory")
	flagUpstream     = flag.Bool("memory.upstream", true, "build and measure upstream's sidecars too (benchmark only)")
	flagMirrors      = flag.String("memory.mirrors", upstream.DefaultMirrors(), "folders (list separated by the OS path separator) holding git mirrors of kubernetes-csi's sidecar repositories; $"+upstream.MirrorsEnv)
	flagOnly         = flag.String("memory.only", "", "measure only these of attacher, provisioner, resizer, combined (comma-separated; default all)")
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
		upstreamBinaries = upstream.BuildAll(*flagMirrors, os.Stderr)
	}
	os.Exit(e2e.Main(m, "../../..", &kube, &binDir))
}
