package realloop

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/csi-sidecars/csi-sidecars/attacher"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cluster"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner"
	"github.com/csi-sidecars/csi-sidecars/resizer"
)

// A Deployment-style rolling upgrade of the controller pod under the real control loop,
// while Pods with claims keep coming: two replicas at the start; each step starts a replica
// with a new identity, waits until it is ready, SIGTERMs the oldest replica and waits for
// its exit. The replicas run at upstream's default flags (--kube-api-qps=5,
// --kube-api-burst=10, leader election with its default 15 s / 10 s / 5 s timings).
const (
	rollingSteps    = 4
	rollingReplicas = 2
	// gracePeriod is a pod's default terminationGracePeriodSeconds: a replica still
	// running this long after SIGTERM is killed, as the kubelet would.
	gracePeriod = 30 * time.Second
	// stallTarget is what a handover should cost at most: the longest time in which work
	// waited and no sidecar made a successful driver call. Printed, never asserted.
	stallTarget = 500 * time.Millisecond
)

// sidecars are the three sidecars of a controller pod, in its containers' order.
func sidecars() []lifecycle.Sidecar {
	return []lifecycle.Sidecar{provisioner.New(), attacher.New(), resizer.New()}
}

// upstreamLeaseTimings are upstream's default Lease timings, which the harness replaces
// with longer ones of its own.
func upstreamLeaseTimings() []string {
	return []string{"--leader-election-lease-duration=15s", "--leader-election-renew-deadline=10s", "--leader-election-retry-period=5s"}
}

// rollout is a variant of the rolling upgrade.
type rollout struct {
	name string
	// from runs the starting replicas: ours or upstream's sidecars. The new replicas are
	// always ours.
	from implementation
	// combined runs ours as one process per replica (`csi-sidecars --controllers=...`);
	// otherwise a replica is one process per sidecar, as a pod of three containers.
	combined bool
	// migration, when set, runs every replica from the containers of manifests instead
	// (migrate_test.go): the starting ones upstream's, the new ones of the first half of
	// the steps `migrate`'s, and those of the second half upstream's again, from `migrate
	// --reverse`: a migration and its rollback.
	migration *migration
}

// rollsBack tells whether step i (from 0) starts upstream's replicas again: the second
// half of a migration's steps.
func (ro rollout) rollsBack(i int) bool { return ro.migration != nil && i >= rollingSteps/2 }

// load is the stream of Pods offered during a rolling upgrade.
type load struct {
	// every: a new Pod with a new claim this often, each living its life (bench_test.go's
	// life: attached, every third claim grown, deleted inUse after its attachment, then
	// its claim).
	every, inUse time.Duration
	// margin is how long Pods come before the first step and after the last one.
	margin time.Duration
}

// testLoad is the short stream of the tests in make test.
func testLoad() load {
	return load{every: time.Second, inUse: 2 * time.Second, margin: 3 * time.Second}
}

// Two csi-sidecars replicas of three single-sidecar processes each are replaced one by one,
// four times, while Pods with claims come and go. Every old replica exits 0 and empties the
// holder of each Lease it held; every claim goes through its whole life, nothing is left,
// and no two driver calls on one volume ever ran at once.
func TestRollingUpgradeOfSingleSidecarReplicas(t *testing.T) {
	r := rollingUpgrade(t, rollout{name: "single-sidecar", from: ours}, testLoad())
	r.log(t)
}

// The same with one `csi-sidecars --controllers=attacher,provisioner,resizer` process per
// replica: one SIGTERM hands over all three Leases.
func TestRollingUpgradeOfCombinedReplicas(t *testing.T) {
	r := rollingUpgrade(t, rollout{name: "combined", from: ours, combined: true}, testLoad())
	r.log(t)
}

// An image swap: the starting replicas run upstream's three sidecars (built from the Go
// module proxy by a benchmark run; skipped until then) and every new one is ours, single-sidecar. Upstream's Lease
// names are ours, so each Lease passes from upstream to ours; upstream does not release its
// Lease on SIGTERM, so a handover from an upstream leader waits for the Lease to expire
// (15 s). Ours still never run two leaders, and the claims' lives complete. (TestMain
// builds upstream's binaries when -test.run selects this test: its name is one of upstreamTests.)
func TestRollingUpgradeFromUpstreamImages(t *testing.T) {
	from := upstreamFrom(t)
	r := rollingUpgrade(t, rollout{name: "image swap", from: from}, testLoad())
	r.log(t)
}

// upstreamFrom is upstream's implementation for an image swap, or skips t saying why
// there is none.
func upstreamFrom(t testing.TB) implementation {
	t.Helper()
	if noLoop != nil {
		t.Skipf("no real control loop: %v", noLoop)
	}
	up, why := upstreamImplementation()
	if why != "" {
		t.Skipf("upstream's sidecars: %s", why)
	}
	// Upstream's identity is the host name: each replica needs one of its own.
	if err := e2e.HostNames(); err != nil {
		t.Skipf("upstream's replicas need host names of their own: %v", err)
	}
	return up
}

// BenchmarkRollingUpgrade runs each rolling upgrade with longer streams of Pods than the
// tests, at each rate of -realloop.rolling-every (by default a Pod every second, about what
// the provisioner's default QPS sustains at five writes per Pod, and every 500 ms, twice
// that: a backlog), each Pod deleted -realloop.rolling-in-use after its attachment, Pods
// coming for -realloop.rolling-margin before the first step and after the last. It prints
// each step's longest stall, the whole upgrade's and the longest before it for comparison,
// the handovers, exit codes and drain times. Figures are printed, never asserted (beyond
// what the tests assert: exits, Leases released, no overlap, nothing left).
func BenchmarkRollingUpgrade(b *testing.B) {
	rates, err := parseIntervals(*flagRollingEvery)
	if err != nil || len(rates) == 0 {
		b.Fatalf("-realloop.rolling-every=%q: want comma-separated positive durations", *flagRollingEvery)
	}
	variants := []rollout{{name: "single-sidecar", from: ours}, {name: "combined", from: ours, combined: true}, {name: "image-swap"}, {name: "migrate-rollback"}}
	for _, ro := range variants {
		for _, every := range rates {
			l := load{every: every, inUse: *flagRollingInUse, margin: *flagRollingMargin}
			b.Run(fmt.Sprintf("%s/every=%v", ro.name, every), func(b *testing.B) {
				switch ro.name {
				case "image-swap":
					ro.from = upstreamFrom(b)
				case "migrate-rollback":
					ro.from = upstreamFrom(b)
					ro.migration = newMigration(b, ro.from)
				}
				for range b.N {
					r := rollingUpgrade(b, ro, l)
					r.log(b)
					b.ReportMetric(r.upgrade.length().Seconds(), "stall-max-s")
					b.ReportMetric(r.before.length().Seconds(), "stall-before-s")
					var after time.Duration
					for _, st := range r.steps {
						after = max(after, st.afterSignal())
					}
					b.ReportMetric(after.Seconds(), "stall-after-sigterm-max-s")
					if ro.migration != nil {
						migrated, rolledBack := r.halves()
						b.ReportMetric(migrated.Seconds(), "stall-migrate-max-s")
						b.ReportMetric(rolledBack.Seconds(), "stall-rollback-max-s")
					}
				}
			})
		}
	}
}

// podReplica is one replica of the controller Deployment: the processes of one pod, which
// share the pod's name as their leader-election identity (ours by flag, upstream's by host
// name).
type podReplica struct {
	id    string
	ours  bool
	procs []*e2e.Replica
	// bySidecar is the process running each sidecar.
	bySidecar map[string]*e2e.Replica
}

// startReplica starts replica id: ours (combined or single-sidecar) or upstream's; in a
// migration, from the manifest of the phase (rollback: migrate --reverse's).
func startReplica(w *world, ro rollout, id string, ours, rollback bool) *podReplica {
	w.T.Helper()
	p := &podReplica{id: id, ours: ours, bySidecar: map[string]*e2e.Replica{}}
	if ro.migration != nil {
		ro.migration.start(w, p, rollback)
		return p
	}
	flags := upstreamLeaseTimings()
	if ours {
		flags = append(flags, requestLogFlags...)
	}
	if ours && ro.combined {
		proc := w.Start(id, []string{"csi-sidecars", "--controllers=attacher,provisioner,resizer"}, flags...)
		p.procs = append(p.procs, proc)
		for _, sc := range sidecars() {
			p.bySidecar[sc.Name()] = proc
		}
		return p
	}
	for _, sc := range sidecars() {
		name := id + "-" + sc.Name()
		var proc *e2e.Replica
		if ours {
			proc = w.Start(name, []string{"csi-sidecars", sc.Name()}, append(flags, "--leader-election-identity="+id)...)
		} else {
			proc = w.StartUpstreamAs(name, id, w.impl.binaries[sc.Name()], flags...)
		}
		p.procs = append(p.procs, proc)
		p.bySidecar[sc.Name()] = proc
	}
	return p
}

// waitReady waits until each of ours answers /readyz (caches synced); upstream's have no
// /readyz.
func (p *podReplica) waitReady(t testing.TB) {
	t.Helper()
	if p.ours {
		for _, proc := range p.procs {
			proc.WaitReady(t)
		}
	}
}

// terminate sends SIGTERM to every process at once, as the kubelet does to a pod's
// containers, and returns when.
func (p *podReplica) terminate(t testing.TB) time.Time {
	t.Helper()
	at := time.Now()
	for _, proc := range p.procs {
		proc.Signal(t, syscall.SIGTERM)
	}
	return at
}

// waitExit waits for every process to exit, killing those still running after the grace
// period as the kubelet would, and returns their exit codes and when the last exited.
func (p *podReplica) waitExit(t testing.TB) (codes []int, killed []string, exited time.Time) {
	t.Helper()
	deadline := time.After(gracePeriod)
	for _, proc := range p.procs {
		select {
		case <-proc.Done:
		case <-deadline:
			killed = append(killed, proc.Name)
			proc.Signal(t, syscall.SIGKILL)
			<-proc.Done
		}
		codes = append(codes, proc.ExitCode)
		exited = later(exited, proc.ExitedAt)
	}
	return codes, killed, exited
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

func earlier(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// step is one step of the upgrade and what it observed.
type step struct {
	old, new *podReplica
	// started: the new replica was started; ready: it was ready; signalled: the old one
	// got SIGTERM; exited: its last process exited.
	started, ready, signalled, exited time.Time
	codes                             []int
	killed                            []string
	// held are the Leases the old replica held at SIGTERM.
	held []string
	// takenOver is when the last of them had a new holder (the end of the stream if one
	// never had); zero when it held none.
	takenOver time.Time
	// takers are their new holders; untaken the Leases nobody took.
	takers, untaken []string
	// releasedToTaken is the longest time from a release to the new holder, as the test's
	// watch saw them.
	releasedToTaken time.Duration
	// stall is the step's longest stall: of those that overlap its handover (from the
	// SIGTERM until the old replica exited and each Lease it held had a new holder), whole.
	stall interval
	// handed is how each Lease held at SIGTERM was handed over (old replicas of ours).
	handed []handover
}

// rolling is what a rolling upgrade measured.
type rolling struct {
	ro    rollout
	load  load
	steps []step
	// before is the longest stall over before the first SIGTERM, with the starting
	// replicas: what the stream costs without any handover. upgrade is the longest of
	// those that overlap the time from the first SIGTERM to the end of the stream.
	before, upgrade interval
	// waits are the Pods' waits for the sidecars.
	waits []wait
	// What the stalls were computed from, for a timeline of a long one: the driver's
	// journal, the Leases' changes and the replicas' process names by socket.
	journal      []testdriver.Call
	leaseChanges []e2e.LeaseChange
	procName     map[string]string
	leaseOf      map[string]string // the sidecar of each Lease
	// writes are the sidecars' API writes from the audit log, read only for a timeline.
	writes []audit.Event
	// procLines are what our replicas logged of their API requests, their waits for a
	// token and their drains and terms, read only for a timeline.
	procLines []procLine
	run       runResult
	took      time.Duration
}

// rollingUpgrade runs a rolling upgrade under a stream of Pods and checks its outcome:
// every old replica of ours exits 0 and empties the holder of each Lease it held; every
// claim was bound, attached, grown where asked, detached and deleted, nothing is left
// (claims, PVs, VolumeAttachments, driver volumes); no two mutating driver calls on one
// volume overlapped. It returns the figures.
func rollingUpgrade(t testing.TB, ro rollout, l load) *rolling {
	began := time.Now()
	var leases *e2e.LeaseWatch
	var replicas []*podReplica
	oursFirst := !ro.from.upstream()
	prefix := map[bool]string{true: "ours", false: "upstream"}
	w := newLoop(t, benchNodes, ro.from, func(w *world) {
		leases = w.WatchLeases()
		for i := range rollingReplicas {
			replicas = append(replicas, startReplica(w, ro, fmt.Sprintf("%s-%d", prefix[oursFirst], i), oursFirst, false))
		}
	})
	driver := w.Driver.DriverName()
	var leaseNames []string
	leaseOf := map[string]string{}
	for _, sc := range sidecars() {
		name := lifecycle.SanitizeName(sc.LeaseName(driver))
		leaseNames = append(leaseNames, name)
		leaseOf[name] = sc.Name()
	}
	for _, p := range replicas {
		p.waitReady(t)
	}
	waitLeasesHeld(w, leaseNames, replicas)

	s := w.startStream("roll", l.every, l.inUse)
	// Without this a failure below would leave lives running after the test.
	t.Cleanup(func() { s.stop() })
	r := &rolling{ro: ro, load: l, leaseOf: leaseOf}
	progress(t, "%s: replicas %s and %s lead or stand by; Pods come every %v", ro.name, replicas[0].id, replicas[1].id, l.every)
	// Offered load before the first step: the workload's shape, not a wait for anything.
	time.Sleep(l.margin)
	for i := range rollingSteps {
		if ro.rollsBack(i) && !ro.rollsBack(i-1) {
			// The migration is over once every Lease passed from upstream's replicas to
			// ours (upstream's, which do not release theirs, leave them to expire): the
			// rollback starts from there.
			var running []*podReplica
			for _, p := range replicas {
				if p.ours {
					running = append(running, p)
				}
			}
			waitLeasesHeld(w, leaseNames, running)
			progress(t, "%s: every Lease held by a replica of ours; rolling back", ro.name)
		}
		st := step{old: replicas[i], started: time.Now()}
		newOurs := !ro.rollsBack(i)
		st.new = startReplica(w, ro, fmt.Sprintf("%s-%d", prefix[newOurs], rollingReplicas+i), newOurs, ro.rollsBack(i))
		replicas = append(replicas, st.new)
		st.new.waitReady(t)
		st.ready = time.Now()
		for _, name := range leaseNames {
			if leases.HolderAt(name, st.ready) == st.old.id {
				st.held = append(st.held, name)
			}
		}
		st.signalled = st.old.terminate(t)
		st.codes, st.killed, st.exited = st.old.waitExit(t)
		r.steps = append(r.steps, st)
		progress(t, "%s: step %d: %s ready after %v; %s (held %s) exited %v after SIGTERM, codes %v; load average %s",
			ro.name, i+1, st.new.id, st.ready.Sub(st.started).Round(time.Millisecond), st.old.id, leasesN(len(st.held)),
			st.exited.Sub(st.signalled).Round(time.Millisecond), st.codes, loadAverage())
	}
	time.Sleep(l.margin) // offered load after the last step
	streamEnd := time.Now()
	names := s.stop()
	progress(t, "%s: %d Pods offered; settling", ro.name, len(names))
	r.run = w.settle(w.work, "roll", names)

	r.took = time.Since(began)
	for i := range r.steps {
		st := &r.steps[i]
		for _, name := range st.held {
			by, at, released := nextHolder(leases.Changes(name), st.old.id, st.signalled)
			if by == "" {
				st.untaken = append(st.untaken, name)
				st.takenOver = streamEnd // the handover lasts as long as the stream
				continue
			}
			st.takenOver = later(st.takenOver, at)
			if !released.IsZero() {
				st.releasedToTaken = max(st.releasedToTaken, at.Sub(released))
			}
			if !slices.Contains(st.takers, by) {
				st.takers = append(st.takers, by)
			}
		}
	}
	// Stalls, from what the workload saw and the driver's journal.
	r.journal, r.leaseChanges = w.Driver.Journal(), leases.Changes("")
	r.waits = sidecarWaits(r.run.items, r.journal, time.Now())
	stalls := subtract(merge(intervals(r.waits)), driverProgress(r.journal, time.Now()))
	r.before = longestWithin(stalls, interval{s.began, r.steps[0].signalled})
	r.upgrade = longestIn(stalls, interval{r.steps[0].signalled, streamEnd})
	for i := range r.steps {
		st := &r.steps[i]
		st.stall = longestIn(stalls, interval{st.signalled, later(st.exited, st.takenOver)})
	}
	now := time.Now()
	byID := map[string]*podReplica{}
	for _, p := range replicas {
		byID[p.id] = p
		if p.ours {
			for _, proc := range p.procs {
				r.procLines = append(r.procLines, parseProcLog(proc.Name, proc.Stderr(), now)...)
			}
		}
	}
	for i := range r.steps {
		if st := &r.steps[i]; st.old.ours {
			st.handed = r.handovers(*st, byID, leases.Changes)
		}
	}
	explained := r.explainsUpgrade()
	for i, st := range r.steps {
		explained = explained || r.explains(st, i)
	}
	if explained {
		// Its timeline shows the sidecars' API writes too, from the audit log.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		events, err := audit.UpTo(ctx, w.Client, auditLog)
		cancel()
		if err != nil {
			t.Logf("no API writes in the timelines: %v", err)
		}
		for _, e := range events {
			if e.IsWrite() && strings.HasPrefix(e.UserAgent, "csi-sidecars") && !e.RequestReceived.Before(s.began) {
				r.writes = append(r.writes, e)
			}
		}
	}

	// Every old replica of ours exited 0 and emptied the holder of every Lease it held.
	for _, st := range r.steps {
		if !st.old.ours {
			continue
		}
		if len(st.killed) > 0 || slices.ContainsFunc(st.codes, func(c int) bool { return c != 0 }) {
			t.Errorf("%s: exit codes %v after SIGTERM (killed after %v: %v); want 0", st.old.id, st.codes, gracePeriod, st.killed)
		}
		for _, name := range leaseNames {
			if why := notReleased(leases.Changes(name), st.old.id); why != "" {
				t.Errorf("Lease %s: %s", name, why)
			}
		}
	}
	if err := leases.Err(); err != nil {
		t.Errorf("the Lease history may be incomplete: %v", err)
	}
	// The last replicas carry on: each Lease held by one of their running processes.
	last := replicas[len(replicas)-rollingReplicas:]
	for i, name := range leaseNames {
		running := map[string]*e2e.Replica{}
		for _, p := range last {
			running[p.id] = p.bySidecar[sidecars()[i].Name()]
		}
		w.WaitForRunningHolder(name, running)
	}
	for _, p := range last {
		for _, proc := range p.procs {
			if !proc.Running() {
				t.Errorf("%s exited with %d during the upgrade", proc.Name, proc.ExitCode)
			}
		}
	}

	// Every claim went through its whole life, and nothing was left.
	for _, it := range r.run.items {
		want := []cluster.Stage{cluster.Bound, cluster.Attached, cluster.Detached, cluster.ClaimGone, cluster.VolumeDeleted}
		switch s.change(it.Name) {
		case grow:
			want = append(want, cluster.Grown)
		case modify:
			want = append(want, cluster.Modified)
		}
		for _, stage := range want {
			if it.Times[stage].IsZero() {
				t.Errorf("Pod %s never reached %s", it.Name, stage)
			}
		}
	}
	if left := r.run.left; left.unbound != 0 || left.stuck != 0 || left.claims != 0 || left.pod != 0 || left.pvs != 0 || left.vas != 0 || left.volumes != 0 {
		t.Errorf("after settling: %d claims never bound, %d Pods whose volume was not deleted; left: %d claims, %d Pods, %d PVs, %d VolumeAttachments, %d driver volumes",
			left.unbound, left.stuck, left.claims, left.pod, left.pvs, left.vas, left.volumes)
		if vs := w.Driver.Volumes(); len(vs) > 0 {
			t.Logf("volumes left in the driver: %+v", vs)
		}
	}
	// No two mutating calls of one sidecar on one volume at once, within a replica or
	// across replicas. Two sidecars may overlap (upstream's attacher publishes again
	// while its resizer modifies).
	r.procName = map[string]string{}
	for _, p := range replicas {
		for _, proc := range p.procs {
			r.procName[proc.Socket] = proc.Name
		}
	}
	for _, o := range w.Driver.Overlaps() {
		if !o.SameSidecar() {
			t.Logf("volume %s: %s by %s and %s by %s overlapped (two sidecars: allowed)", o.Volume,
				o.First.Method, r.procName[o.First.Socket], o.Second.Method, r.procName[o.Second.Socket])
			continue
		}
		t.Errorf("volume %s: %s by %s (%v to %v) overlapped %s by %s (from %v)", o.Volume,
			o.First.Method, r.procName[o.First.Socket], o.First.Start.Format(time.StampMilli), o.First.End.Format(time.StampMilli),
			o.Second.Method, r.procName[o.Second.Socket], o.Second.Start.Format(time.StampMilli))
	}
	if err := w.cluster.Running(); err != nil {
		t.Error(err)
	}
	return r
}

// loadAverage is the machine's load average over 1, 5 and 15 minutes: timings on a shared
// machine mean little without it.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// progress reports how a run goes: on stdout for a benchmark (whose log is shown only at
// its end), in the test's log otherwise.
func progress(t testing.TB, format string, args ...any) {
	t.Helper()
	if _, bench := t.(*testing.B); bench {
		say(format, args...)
		return
	}
	t.Logf(format, args...)
}

// waitLeasesHeld waits until each Lease is held by one of the replicas.
func waitLeasesHeld(w *world, leaseNames []string, replicas []*podReplica) {
	w.T.Helper()
	for i, name := range leaseNames {
		running := map[string]*e2e.Replica{}
		for _, p := range replicas {
			running[p.id] = p.bySidecar[sidecars()[i].Name()]
		}
		w.WaitForRunningHolder(name, running)
	}
}

// notReleased says how a replica's terms of a Lease did not end with the holder emptied,
// "" when each did (or it never held the Lease).
func notReleased(changes []e2e.LeaseChange, id string) string {
	for i, c := range changes {
		if c.Holder != id || (i > 0 && changes[i-1].Holder == id) {
			continue
		}
		// A term of id begins at i; the first change of holder after it ends it.
		j := i + 1
		for j < len(changes) && changes[j].Holder == id {
			j++
		}
		switch {
		case j == len(changes):
			return fmt.Sprintf("%s still holds it after its exit", id)
		case changes[j].Deleted:
			return fmt.Sprintf("deleted while %s held it", id)
		case changes[j].Holder != "":
			return fmt.Sprintf("passed from %s to %s without being released (holder emptied)", id, changes[j].Holder)
		}
	}
	return ""
}

// nextHolder is the first holder other than id (and not empty) seen after `after`, when
// it took the Lease, and when the Lease was released before that (zero if it was not); ""
// when there was none. The times are the records' own (written), falling back to when the
// watch saw them.
func nextHolder(changes []e2e.LeaseChange, id string, after time.Time) (by string, at, released time.Time) {
	for _, c := range changes {
		if !c.At.After(after) {
			continue
		}
		if c.Holder == "" && !c.Deleted {
			released = written(c)
		}
		if c.Holder != "" && c.Holder != id {
			return c.Holder, written(c), released
		}
	}
	return "", time.Time{}, time.Time{}
}

// written is when a Lease record was written, by its writer's clock (the same machine's),
// else when the watch saw it.
func written(c e2e.LeaseChange) time.Time {
	if c.Written.IsZero() {
		return c.At
	}
	return c.Written
}

// podStream offers a new Pod with a new claim at a fixed rate until stopped, each living
// its life in a goroutine of its own.
type podStream struct {
	began time.Time
	quit  chan struct{}
	done  chan struct{}
	lives sync.WaitGroup
	once  sync.Once

	mu      sync.Mutex
	names   []string
	changes map[string]lifeChange // what each claim's life changes of it
}

// change is what the Pod's life was to change of its claim.
func (s *podStream) change(name string) lifeChange {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changes[name]
}

// startStream starts offering Pods named <prefix>-NNN of the world's workload, the first at
// once, a new one every `every`; each is deleted inUse after its volume is attached, every
// third claim grown first and every third given a new VolumeAttributesClass (lifeChangeOf).
func (w *world) startStream(prefix string, every, inUse time.Duration) *podStream {
	s := &podStream{began: time.Now(), quit: make(chan struct{}), done: make(chan struct{}), changes: map[string]lifeChange{}}
	go func() {
		defer close(s.done)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for i := 0; ; i++ {
			name, change := fmt.Sprintf("%s-%03d", prefix, i), lifeChangeOf(i)
			s.mu.Lock()
			s.names = append(s.names, name)
			s.changes[name] = change
			s.mu.Unlock()
			s.lives.Go(func() { w.life(w.work, name, change, inUse) })
			select {
			case <-s.quit:
				return
			case <-tick.C:
			}
		}
	}()
	return s
}

// stop ends the offer, waits for every life to end and returns the Pods offered.
func (s *podStream) stop() []string {
	s.once.Do(func() { close(s.quit) })
	<-s.done
	s.lives.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.names)
}

// interval is a span of time [from, to).
type interval struct{ from, to time.Time }

func (i interval) length() time.Duration {
	if i.to.Before(i.from) {
		return 0
	}
	return i.to.Sub(i.from)
}

// wait is a time a Pod waited for a sidecar, and for what.
type wait struct {
	interval
	what string
}

// sidecarWaits are the times Pods waited for a sidecar's driver call: from its node's
// selection to the CreateVolume of its volume, from its scheduling to the
// ControllerPublishVolume, from a growth's request to the ControllerExpandVolume, from a
// new VolumeAttributesClass to the ControllerModifyVolume, from its
// deletion to the ControllerUnpublishVolume, and from its claim's deletion to the
// DeleteVolume (the first successful one that was still running when the wait began, from
// the journal). Without such a call a wait ends when the workload saw its stage reached
// (provisioned, attached, grown, modified, detached, volume deleted), and a wait not over by then is
// counted until end. The API writes that record a call's result are not waited for: they
// are not driver calls. A wait includes kube-controller-manager's part before a sidecar
// can act (creating and deleting VolumeAttachments, handing claims over), which takes the
// same little time with or without an upgrade.
func sidecarWaits(items []cluster.Item, calls []testdriver.Call, end time.Time) []wait {
	waits := []struct {
		what     string
		from, to cluster.Stage
		method   string
	}{
		{"provision", cluster.NodeSelected, cluster.Provisioned, testdriver.MethodCreateVolume},
		{"attach", cluster.Scheduled, cluster.Attached, testdriver.MethodControllerPublishVolume},
		{"grow", cluster.GrowRequested, cluster.Grown, testdriver.MethodControllerExpandVolume},
		{"modify", cluster.ModifyRequested, cluster.Modified, testdriver.MethodControllerModifyVolume},
		{"detach", cluster.PodDeleted, cluster.Detached, testdriver.MethodControllerUnpublishVolume},
		{"delete", cluster.ClaimGone, cluster.VolumeDeleted, testdriver.MethodDeleteVolume},
	}
	var out []wait
	for _, it := range items {
		for _, wt := range waits {
			from, ok := it.Times[wt.from]
			if !ok {
				continue
			}
			// A volume never attached is never detached, nor deleted if never provisioned.
			if wt.to == cluster.Detached && it.Times[cluster.Attached].IsZero() ||
				wt.to == cluster.VolumeDeleted && it.Times[cluster.Provisioned].IsZero() {
				continue
			}
			to, ok := it.Times[wt.to]
			if !ok {
				to = end
			}
			for _, c := range calls {
				if c.Method != wt.method || !c.Done() || c.Code != "OK" || c.Canceled || c.End.Before(from) {
					continue
				}
				if c.Method == testdriver.MethodCreateVolume && c.VolumeName == it.PersistentVolume && it.PersistentVolume != "" ||
					c.Method != testdriver.MethodCreateVolume && c.VolumeID == it.VolumeHandle && it.VolumeHandle != "" {
					to = earlier(to, later(from, c.Start))
					break
				}
			}
			out = append(out, wait{interval{from, to}, wt.what})
		}
	}
	return out
}

func intervals(ws []wait) []interval {
	out := make([]interval, len(ws))
	for i, w := range ws {
		out[i] = w.interval
	}
	return out
}

// waitingFor lists what the waits overlapping stall waited for, by how many.
func waitingFor(ws []wait, stall interval) string {
	n := map[string]int{}
	var order []string
	for _, w := range ws {
		if w.from.Before(stall.to) && w.to.After(stall.from) {
			if n[w.what] == 0 {
				order = append(order, w.what)
			}
			n[w.what]++
		}
	}
	parts := make([]string, len(order))
	for i, what := range order {
		parts[i] = fmt.Sprintf("%d %s", n[what], what)
	}
	return strings.Join(parts, ", ")
}

// driverProgress is when some sidecar's successful call changed the driver's state
// (create, delete, publish, unpublish, expand, modify), from its start to its end; a call
// still running is counted until end.
func driverProgress(calls []testdriver.Call, end time.Time) []interval {
	var out []interval
	for _, c := range calls {
		switch c.Method {
		case testdriver.MethodCreateVolume, testdriver.MethodDeleteVolume,
			testdriver.MethodControllerPublishVolume, testdriver.MethodControllerUnpublishVolume,
			testdriver.MethodControllerExpandVolume, testdriver.MethodControllerModifyVolume:
		default:
			continue
		}
		switch {
		case !c.Done():
			out = append(out, interval{c.Start, end})
		case c.Code == "OK" && !c.Canceled:
			out = append(out, interval{c.Start, c.End})
		}
	}
	return merge(out)
}

// merge sorts intervals and joins those that overlap or touch.
func merge(in []interval) []interval {
	sorted := slices.Clone(in)
	slices.SortFunc(sorted, func(a, b interval) int { return a.from.Compare(b.from) })
	var out []interval
	for _, i := range sorted {
		if i.length() == 0 {
			continue
		}
		if n := len(out); n > 0 && !i.from.After(out[n-1].to) {
			out[n-1].to = later(out[n-1].to, i.to)
			continue
		}
		out = append(out, i)
	}
	return out
}

// subtract is the parts of waiting (merged) that no interval of progress (merged) covers:
// the stalls.
func subtract(waiting, progress []interval) []interval {
	var out []interval
	p := 0
	for _, w := range waiting {
		from := w.from
		for p < len(progress) && !progress[p].to.After(from) {
			p++
		}
		for q := p; q < len(progress) && progress[q].from.Before(w.to); q++ {
			if progress[q].from.After(from) {
				out = append(out, interval{from, progress[q].from})
			}
			from = later(from, progress[q].to)
		}
		if from.Before(w.to) {
			out = append(out, interval{from, w.to})
		}
	}
	return out
}

// longestIn is the longest stall that overlaps window, whole.
func longestIn(stalls []interval, window interval) interval {
	var longest interval
	for _, s := range stalls {
		if s.from.Before(window.to) && s.to.After(window.from) && s.length() > longest.length() {
			longest = s
		}
	}
	return longest
}

// longestWithin is the longest stall that lies within window.
func longestWithin(stalls []interval, window interval) interval {
	var longest interval
	for _, s := range stalls {
		if !s.from.Before(window.from) && !s.to.After(window.to) && s.length() > longest.length() {
			longest = s
		}
	}
	return longest
}

// log prints the upgrade's figures. A benchmark's log keeps only its first lines: timelines
// go to progress.
func (r *rolling) log(t testing.TB) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "FIGURE rolling upgrade, %s: %d steps, %d Pods (a new one every %v, deleted %v after attached), %v in all\n",
		r.ro.name, len(r.steps), r.run.pods, r.load.every, r.load.inUse, r.took.Round(time.Second))
	for i, st := range r.steps {
		held := "no Lease"
		switch {
		case len(st.untaken) > 0:
			held = fmt.Sprintf("%s, %d not taken over", leasesN(len(st.held)), len(st.untaken))
		case len(st.held) > 0:
			held = fmt.Sprintf("%s, taken over by %s at SIGTERM+%v", leasesN(len(st.held)), strings.Join(st.takers, ", "),
				st.takenOver.Sub(st.signalled).Round(time.Millisecond))
			if st.releasedToTaken > 0 {
				held += fmt.Sprintf(" (at most %v after a release)", st.releasedToTaken.Round(time.Millisecond))
			}
		}
		fmt.Fprintf(&b, "FIGURE rolling upgrade, %s: step %d: %s ready %v after start; %s held %s; exit %v at SIGTERM+%v; longest stall %v (%s)\n",
			r.ro.name, i+1, st.new.id, st.ready.Sub(st.started).Round(time.Millisecond), st.old.id, held, exitCodes(st.codes, st.killed),
			st.exited.Sub(st.signalled).Round(time.Millisecond), st.stall.length().Round(time.Millisecond), r.where(i))
	}
	var after time.Duration
	for _, st := range r.steps {
		after = max(after, st.afterSignal())
	}
	fmt.Fprintf(&b, "FIGURE rolling upgrade, %s: whole upgrade: longest stall %v (%s; target < %v; waiting: %s); before the upgrade %v; longest part of a step's stall after its SIGTERM %v\n",
		r.ro.name, r.upgrade.length().Round(time.Millisecond), r.place(r.upgrade.from), stallTarget, waitingFor(r.waits, r.upgrade), r.before.length().Round(time.Millisecond),
		after.Round(time.Millisecond))
	t.Log(strings.TrimSuffix(b.String(), "\n"))
	// Where each handover's stall went.
	for i, st := range r.steps {
		if bd := r.breakdown(st); bd != "" && st.old.ours {
			progress(t, "%s: step %d's handover: %s", r.ro.name, i+1, bd)
		}
	}
	// A handover of ours past the target: what happened around it.
	for i, st := range r.steps {
		if r.explains(st, i) {
			progress(t, "%s: step %d's stall of %v, timeline (ms from its SIGTERM):\n%s", r.ro.name, i+1,
				st.stall.length().Round(time.Millisecond), r.timeline(st))
		}
	}
	if r.explainsUpgrade() {
		progress(t, "%s: the whole upgrade's longest stall, %v (%s), timeline (ms from its start):\n%s", r.ro.name,
			r.upgrade.length().Round(time.Millisecond), r.place(r.upgrade.from), r.timelineOf(r.upgrade, r.upgrade.from, r.upgrade.to))
	}
}

// explainsUpgrade tells whether the whole upgrade's longest stall gets a timeline of its
// own: past the target, and no step's (a step's has its own).
func (r *rolling) explainsUpgrade() bool {
	if r.upgrade.length() <= stallTarget {
		return false
	}
	for _, st := range r.steps {
		if st.stall == r.upgrade {
			return false
		}
	}
	return true
}

// place says when t was relative to the steps: after which event of which step.
func (r *rolling) place(t time.Time) string {
	where := "before the first step"
	for i, st := range r.steps {
		for _, e := range []struct {
			what string
			at   time.Time
		}{{"new replica started", st.started}, {"new replica ready", st.ready}, {"SIGTERM", st.signalled}, {"old replica exited", st.exited}} {
			if !e.at.After(t) {
				where = fmt.Sprintf("%v after step %d: %s", t.Sub(e.at).Round(time.Millisecond), i+1, e.what)
			}
		}
	}
	return where
}

// explains tells whether step i gets a timeline: a handover of ours past the target, the
// first step of that stall. (Upstream's wait for their Leases to expire.)
func (r *rolling) explains(st step, i int) bool {
	return st.old.ours && st.stall.length() > stallTarget && (i == 0 || r.steps[i-1].stall != st.stall)
}

// timeline lists what happened from shortly before a step's stall to shortly after it:
// the step's own events, changes of Lease holders, driver calls starting and ending, the
// stages the Pods reached and the sidecars' API writes (when the API server received them:
// after client-go's rate limiter let them go).
func (r *rolling) timeline(st step) string {
	// Until the old replica exited and its Leases were taken (at most 3 s past the stall):
	// its drain is the reason of many a stall.
	end := later(st.stall.to, earlier(later(st.exited, st.takenOver), st.stall.to.Add(3*time.Second)))
	return r.timelineOf(st.stall, st.signalled, end)
}

// timelineOf lists what happened from a second before stall to 200 ms after end, in
// milliseconds from ref: every step's events, changes of Lease holders, driver calls
// starting and ending, the stages the Pods reached, the sidecars' API writes as the API
// server received them (after client-go's rate limiter let them go) and what our
// replicas logged of their requests, their waits for tokens and their terms.
func (r *rolling) timelineOf(stall interval, ref, end time.Time) string {
	from, to := stall.from.Add(-time.Second), end.Add(200*time.Millisecond)
	type event struct {
		at   time.Time
		what string
	}
	var events []event
	add := func(at time.Time, format string, args ...any) {
		if !at.Before(from) && !at.After(to) {
			events = append(events, event{at, fmt.Sprintf(format, args...)})
		}
	}
	add(stall.from, "-- the stall begins")
	add(stall.to, "-- the stall ends")
	for i, st := range r.steps {
		add(st.started, "step %d: %s started", i+1, st.new.id)
		add(st.ready, "step %d: %s ready", i+1, st.new.id)
		add(st.signalled, "step %d: SIGTERM to %s", i+1, st.old.id)
		for _, proc := range st.old.procs {
			add(proc.ExitedAt, "%s exited %d", proc.Name, proc.ExitCode)
		}
	}
	for _, c := range r.leaseChanges {
		holder := c.Holder
		if holder == "" {
			holder = "nobody (released)"
		}
		add(written(c), "%s Lease held by %s (seen at %+d)", r.leaseOf[c.Lease], holder, c.At.Sub(ref).Milliseconds())
	}
	for _, c := range r.journal {
		if c.Method == testdriver.MethodProbe || c.Method == testdriver.MethodControllerGetCapabilities {
			continue
		}
		add(c.Start, "%s %s %s starts", r.procName[c.Socket], c.Method, c.VolumeID+c.VolumeName)
		if c.Done() {
			add(c.End, "%s %s %s ends %s", r.procName[c.Socket], c.Method, c.VolumeID+c.VolumeName, c.Code)
		}
	}
	for _, it := range r.run.items {
		for stage, at := range it.Times {
			add(at, "%s %s", it.Name, stage)
		}
	}
	for _, e := range r.writes {
		add(e.RequestReceived, "audit: %s: %s %s %s: %d, answered in %v", e.UserAgent, e.Verb, e.Resource(), e.Name(), e.Code(),
			e.StageTimestamp.Sub(e.RequestReceived).Round(time.Millisecond))
	}
	for _, l := range r.procLines {
		switch l.kind {
		case "throttled":
			add(l.start(), "%s: %s %s waits for a token", l.proc, l.verb, l.path)
		case "request":
			if strings.HasPrefix(l.path, "leases/") && l.verb == "GET" {
				continue // standbys' and leaders' Lease reads: many, and no work
			}
		}
		add(l.at, "%s", l)
	}
	slices.SortStableFunc(events, func(a, b event) int { return a.at.Compare(b.at) })
	var b strings.Builder
	for _, e := range events {
		fmt.Fprintf(&b, "  %+6d %s\n", e.at.Sub(ref).Milliseconds(), e.what)
	}
	return b.String()
}

func leasesN(n int) string {
	if n == 1 {
		return "1 Lease"
	}
	return fmt.Sprintf("%d Leases", n)
}

// where places step i's longest stall relative to its SIGTERM, or names the earlier step
// whose stall it is, and says what waited.
func (r *rolling) where(i int) string {
	st := r.steps[i]
	if st.stall.length() == 0 {
		return "none"
	}
	for j := range i {
		if r.steps[j].stall == st.stall {
			return fmt.Sprintf("step %d's, still", j+1)
		}
	}
	d := st.stall.from.Sub(st.signalled)
	at := fmt.Sprintf("from SIGTERM+%v", d.Round(time.Millisecond))
	if d < 0 {
		at = fmt.Sprintf("from %v before SIGTERM, %v of it after", (-d).Round(time.Millisecond), st.afterSignal().Round(time.Millisecond))
	}
	return at + "; waiting: " + waitingFor(r.waits, st.stall)
}

// afterSignal is the part of the step's stall after its SIGTERM: what the handover added
// to a stall that was already under way (a backlog's) when the signal came.
func (st step) afterSignal() time.Duration {
	return interval{later(st.stall.from, st.signalled), st.stall.to}.length()
}

// exitCodes renders a replica's exit codes: "signal" for a process the signal ended
// (upstream's sidecars do not handle SIGTERM unless their ReleaseLeaderElectionOnExit gate
// is on, and it is off by default), and which were killed after the grace period.
func exitCodes(codes []int, killed []string) string {
	out := make([]string, len(codes))
	for i, c := range codes {
		out[i] = fmt.Sprint(c)
		if c == -1 {
			out[i] = "signal"
		}
	}
	if len(killed) > 0 {
		return fmt.Sprintf("%v (killed after %v: %s)", out, gracePeriod, strings.Join(killed, ", "))
	}
	return fmt.Sprint(out)
}

// A stall is a time in which some Pod waited for a sidecar's driver call and no successful
// mutating driver call ran; failed calls and reads are no progress, a call still running
// is. A wait ends with the successful call for its volume, else with its stage.
func TestStallsAreWaitsWithoutSuccessfulDriverCalls(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	items := []cluster.Item{
		// Waits for provisioning from 0 (until its CreateVolume at 700, not until the PV
		// was seen at 1000) and for attachment from 1500 (until its publish at 2000).
		{Name: "a", PersistentVolume: "pvc-a", VolumeHandle: "vol-a", Times: map[cluster.Stage]time.Time{cluster.NodeSelected: at(0),
			cluster.Provisioned: at(1000), cluster.Scheduled: at(1500), cluster.Attached: at(3000)}},
		// Waits for its detachment from 2800; its unpublish still runs: until the end, 5000.
		{Name: "b", VolumeHandle: "vol-b", Times: map[cluster.Stage]time.Time{cluster.Attached: at(100), cluster.PodDeleted: at(2800)}},
		// Never attached: no wait for a detachment.
		{Name: "c", Times: map[cluster.Stage]time.Time{cluster.PodDeleted: at(200)}},
	}
	call := func(method, volume string, from, to int, code string) testdriver.Call {
		c := testdriver.Call{Method: method, VolumeID: volume, Start: at(from), Code: code}
		if method == testdriver.MethodCreateVolume {
			c.VolumeName = volume
		}
		if to >= 0 {
			c.End = at(to)
		}
		return c
	}
	calls := []testdriver.Call{
		call(testdriver.MethodCreateVolume, "pvc-x", 100, 200, "OK"),          // another volume's
		call(testdriver.MethodCreateVolume, "pvc-a", 300, 400, "Unavailable"), // failed: no progress
		call(testdriver.MethodListVolumes, "", 500, 600, "OK"),                // a read: no progress
		call(testdriver.MethodCreateVolume, "pvc-a", 700, 900, "OK"),
		call(testdriver.MethodControllerPublishVolume, "vol-a", 2000, 2100, "OK"),
		call(testdriver.MethodControllerUnpublishVolume, "vol-b", 4000, -1, ""), // still running
	}
	waits := sidecarWaits(items, calls, at(5000))
	got := subtract(merge(intervals(waits)), driverProgress(calls, at(5000)))
	want := []interval{{at(0), at(100)}, {at(200), at(700)}, {at(1500), at(2000)}, {at(2800), at(4000)}}
	if !slices.Equal(got, want) {
		t.Errorf("stalls:\n got %v\nwant %v", got, want)
	}
	if l := longestIn(got, interval{at(1200), at(1600)}); l != (interval{at(1500), at(2000)}) {
		t.Errorf("longest stall overlapping 1200-1600 ms: %v, want 1500-2000 ms", l)
	}
	if l := longestIn(got, interval{at(4000), at(5000)}); l.length() != 0 {
		t.Errorf("longest stall overlapping 4000-5000 ms: %v, want none", l)
	}
	if l := longestWithin(got, interval{at(0), at(1600)}); l != (interval{at(200), at(700)}) {
		t.Errorf("longest stall within 0-1600 ms: %v, want 200-700 ms", l)
	}
	if what := waitingFor(waits, interval{at(200), at(700)}); what != "1 provision" {
		t.Errorf("waiting during the stall 200-700 ms: %q, want 1 provision", what)
	}
	if what := waitingFor(waits, interval{at(2800), at(4000)}); what != "1 detach" {
		t.Errorf("waiting during the stall 2800-4000 ms: %q, want 1 detach", what)
	}
}
