// Package realloop runs the three sidecars (`csi-sidecars provisioner`, `attacher` and
// `resizer`, one process each, with upstream's default flags) under the real control loop:
// a real kube-controller-manager and kube-scheduler with fake nodes (internal/testkit/cluster), so
// that Pods with claims go through their whole life as in a cluster. The scheduler picks a
// node for each Pod, kube-controller-manager hands the claim to the provisioner, binds it,
// creates the VolumeAttachment for the attacher, hands growth to the resizer, and detaches
// and lets go of the claim and its volume after the Pod and the claim are deleted. The tests
// check the API objects and the test CSI driver's journal at each step. They skip when
// kube-controller-manager or kube-scheduler is not built (`make testenv`).
//
// BenchmarkRealControlLoop (make bench) runs the same workload with ours and with upstream's
// three binaries (internal/testkit/upstream builds them from the Go module proxy before the
// benchmark starts; when a build fails it measures ours only and says why) and prints them side by side:
// per-stage latency and throughput, what is left after settling, the API writes per
// operation from the API server's audit log, and goodput against offered load. Figures are
// printed, never asserted.
//
// The rolling-upgrade tests (rolling_test.go) replace the controller pod's replicas one by
// one, as a Deployment does, while Pods with claims keep coming: single-sidecar replicas,
// combined ones, and from upstream's images to ours. They check exits, released Leases, every
// claim's whole life and the driver's journal, and print each handover's longest stall;
// BenchmarkRollingUpgrade does the same with longer streams.
package realloop

import (
	"flag"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cluster"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstream"
)

var (
	kube   controlplane.Shared
	binDir string
	// noLoop says why the real control loop cannot run: kube-apiserver and etcd are built
	// but kube-controller-manager or kube-scheduler is not. The tests then skip without a
	// control plane started or binaries built for them.
	noLoop error
	// auditLog is the API server's audit log: every write at Metadata level, events' with
	// their body (auditPolicy).
	auditLog string
	// upstreamBinaries are upstream's sidecars by name, built (or found cached) by TestMain
	// whenever a control plane runs, for the benchmarks and the rolling upgrade from
	// upstream's images (so a first build, minutes once per machine, does not count against
	// -timeout); nil otherwise.
	upstreamBinaries map[string]upstream.Binary

	flagUpstream      = flag.Bool("realloop.upstream", true, "run upstream's sidecars too (the benchmarks, the rolling upgrade from upstream's images), built from the Go module proxy")
	flagLifePods      = flag.Int("realloop.life-pods", 30, "benchmark: Pods of the life run")
	flagLifeInterval  = flag.Duration("realloop.life-interval", 2*time.Second, "benchmark: a new Pod of the life run this often")
	flagInUse         = flag.Duration("realloop.in-use", 10*time.Second, "benchmark: a life run's Pod is deleted this long after its volume is attached")
	flagStream        = flag.Duration("realloop.stream", 40*time.Second, "benchmark: how long each goodput run offers new Pods")
	flagRollingEvery  = flag.String("realloop.rolling-every", "1s,500ms", "benchmark: the rolling upgrades' streams, a new Pod this often each (comma-separated durations)")
	flagRollingInUse  = flag.Duration("realloop.rolling-in-use", 5*time.Second, "benchmark: a rolling upgrade's Pod is deleted this long after its volume is attached")
	flagRollingMargin = flag.Duration("realloop.rolling-margin", 10*time.Second, "benchmark: a rolling upgrade's Pods come this long before its first step and after its last")
	flagIntervals     = flag.String("realloop.intervals", "1200ms,600ms,300ms", "benchmark: the goodput runs, a new Pod this often each (comma-separated durations)")
)

// auditPolicy logs every write at Metadata level, with the body of events (whose involved
// object and source tell which volume and which sidecar they are about), and the marker
// audit.UpTo sends. Reads are not logged: the benchmark counts writes.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
` + audit.MarkerRule + audit.WriteRules + `- level: None
`

func TestMain(m *testing.M) { os.Exit(run(m)) }

func run(m *testing.M) int {
	flag.Parse()
	// A missing kube-apiserver fails the package in e2e.Main, as everywhere else.
	if _, err := controlplane.Assets(); err == nil {
		if _, noLoop = cluster.Assets(); noLoop != nil {
			return m.Run()
		}
	}
	dir, err := os.MkdirTemp("", "csi-sidecars-realloop-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	args, log, err := audit.Setup(dir, auditPolicy)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	auditLog = log
	if *flagUpstream && !testing.Short() && os.Getenv(controlplane.SkipEnv) != "1" && runsUpstream() {
		if e2e.Benchmarks() {
			upstreamBinaries = upstream.BuildAll(os.Stderr)
		} else {
			// Tests use upstream's binaries only when a benchmark run built them: a first
			// build takes many minutes, too long for `make test`.
			upstreamBinaries = upstream.CachedAll()
		}
	}
	return e2e.MainWith(m, "../../..", &kube, &binDir, controlplane.Options{APIServerArgs: args})
}

// upstreamTests are the tests that run upstream's binaries; the benchmarks do too.
var upstreamTests = []string{"TestRollingUpgradeFromUpstreamImages", "TestLiveMigrationWithMigrateAndRollbackWithReverse"}

// runsUpstream tells whether this run may need upstream's binaries: benchmarks run, or
// -test.run may select one of upstreamTests. A run of other tests does not build them.
func runsUpstream() bool {
	if e2e.Benchmarks() {
		return true
	}
	run := flag.Lookup("test.run")
	if run == nil || run.Value.String() == "" {
		return true
	}
	top, _, _ := strings.Cut(run.Value.String(), "/")
	re, err := regexp.Compile(top)
	return err != nil || slices.ContainsFunc(upstreamTests, re.MatchString)
}
