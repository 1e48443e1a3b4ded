// Command demo is `make demo`: on one machine it starts a real kube-apiserver + etcd, the
// test CSI driver with slow calls, and two replicas of each sidecar; it provisions, attaches
// and expands volumes, SIGTERMs each leader while its calls are in flight, and prints a live
// timeline and a summary of each handover. With -combined it then does the same work with
// two replicas of one process running all three sidecars (csi-sidecars --controllers=...),
// which one SIGTERM hands over, and compares their memory. Everything it starts stops with
// it (also on Ctrl-C); the logs stay in the folder it names.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/internal/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

const (
	driverName    = "demo.csi.sidecars.io"
	demoNamespace = "demo"
	// The combined run has a driver of its own, so Leases, volumes and journal of the two
	// runs never mix.
	combinedDriverName = "combined.demo.csi.sidecars.io"
	combinedNamespace  = "demo-combined"
	controllers        = "--controllers=attacher,provisioner,resizer"
)

type options struct {
	short    bool   // CI mode: fewer volumes, shorter calls
	combined bool   // after the single-sidecar run, the combined one
	bin      string // the csi-sidecars binary
	logDir   string
	volumes  int
	latency  time.Duration
}

func main() {
	var o options
	flag.BoolVar(&o.short, "short", false, "fewer volumes and shorter calls (for CI)")
	flag.BoolVar(&o.combined, "combined", false, "then do the same work with two processes that each run all three sidecars ("+controllers+"), one SIGTERM for the three Leases")
	flag.StringVar(&o.bin, "bin", "_output/bin/csi-sidecars", "the csi-sidecars binary")
	flag.StringVar(&o.logDir, "logs", "", "folder for the logs (default _output/demo/<time>)")
	flag.Parse()
	if o.logDir == "" {
		o.logDir = filepath.Join("_output", "demo", time.Now().Format("20060102-150405"))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if _, err := run(ctx, o, os.Stdout); err != nil {
		fmt.Fprintf(os.Stderr, "demo failed: %v\n", err)
		os.Exit(1)
	}
}

// demo is one run: the cluster, the driver, the replicas and the timeline. The combined run
// is a copy with a driver, namespace and storage of its own.
type demo struct {
	o         options
	out       io.Writer
	began     time.Time
	kube      kubernetes.Interface
	driver    *testdriver.Backend
	cp        *controlplane.ControlPlane
	namespace string
	store     e2e.Storage
	procs     *procs // of both runs, so that every one is stopped at the end
}

// procs are the replicas started so far.
type procs struct {
	mu   sync.Mutex
	list []*replica
}

func (p *procs) add(r *replica) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.list = append(p.list, r)
}

func (p *procs) all() []*replica {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.list)
}

// report is what run found, for the test and the benchmark.
type report struct {
	single []handover // one per sidecar, each its own pair of processes
	// With -combined: one per sidecar, all in the one pair of combined processes, and the
	// peak memory of the combined standby that finished the work.
	combined        []handover
	combinedPeakRSS int64
}

// handover is what the summary table shows for one sidecar.
type handover struct {
	sidecar, method     string
	leader, standby     string
	inFlight            int
	drain               time.Duration
	exitCode            int
	firstCallAfterExit  time.Duration
	overlaps, done, all int
	standbyPeakRSS      int64 // bytes, VmHWM of the standby after it finished the work
}

// run is the whole demo; it returns each handover, for the test and the benchmark.
func run(ctx context.Context, o options, out io.Writer) (rep report, err error) {
	o.volumes, o.latency = 8, 3*time.Second
	if o.short {
		o.volumes, o.latency = 4, time.Second
	}
	// Sockets live in the log folder; gRPC needs their paths absolute.
	if o.logDir, err = filepath.Abs(o.logDir); err != nil {
		return rep, err
	}
	if err := os.MkdirAll(o.logDir, 0o755); err != nil {
		return rep, err
	}
	d := &demo{o: o, out: out, began: time.Now(), procs: &procs{}}
	defer func() {
		d.cleanUp()
		journals := "driver-journal.jsonl"
		if o.combined {
			journals += ", driver-journal-combined.jsonl"
		}
		fmt.Fprintf(out, "\nLogs: %s (one file per replica, apiserver.log, etcd.log, %s)\n", o.logDir, journals)
	}()

	d.say("starting kube-apiserver + etcd on loopback")
	if d.cp, err = controlplane.Start(ctx, controlplane.Options{LogDir: o.logDir}); err != nil {
		return rep, err
	}
	d.kube = kubernetes.NewForConfigOrDie(d.cp.Config())
	closeJournal, err := d.setUp(ctx, driverName, demoNamespace, "demo-fast", "demo-node", "driver-journal.jsonl")
	if err != nil {
		return rep, err
	}
	defer closeJournal()

	sanitized := lifecycle.SanitizeName(driverName)
	phases := []struct {
		sidecar, lease, method string
		flags                  []string
		work                   func(context.Context) error
		done                   func(context.Context) (int, error)
	}{
		{"provisioner", sanitized, testdriver.MethodCreateVolume, []string{"--worker-threads=2"}, d.createClaims, d.countProvisioned},
		{"attacher", "external-attacher-leader-" + sanitized, testdriver.MethodControllerPublishVolume, []string{"--worker-threads=2"}, d.createAttachments, d.countAttached},
		{"resizer", "external-resizer-" + sanitized, testdriver.MethodControllerExpandVolume, []string{"--workers=2"}, d.expandClaims, d.countExpanded},
	}
	for _, p := range phases {
		if err := d.startPair(ctx, p.sidecar, append([]string{p.sidecar}, p.flags...), []string{p.lease}); err != nil {
			return rep, err
		}
	}
	for _, p := range phases {
		h, err := d.handover(ctx, p.sidecar, p.lease, p.method, p.work, p.done)
		rep.single = append(rep.single, h)
		if err != nil {
			d.summary(rep.single)
			return rep, fmt.Errorf("%s: %w", p.sidecar, err)
		}
		if p.sidecar == "provisioner" {
			if err := d.bindAll(ctx); err != nil {
				return rep, err
			}
		}
	}
	d.summary(rep.single)
	for _, h := range rep.single {
		if h.exitCode != 0 || h.overlaps != 0 || h.done != h.all {
			return rep, errors.New("a handover was not clean (see the table)")
		}
	}
	if !o.combined {
		return rep, nil
	}

	// The single-sidecar replicas are done; stopped, they leave the machine's cores to the
	// combined run.
	for _, r := range d.procs.all() {
		r.kill()
	}
	fmt.Fprintf(d.out, "\n== combined: csi-sidecars %s, two replicas, %d volumes\n", controllers, o.volumes)
	c := *d
	closeCombined, err := c.setUp(ctx, combinedDriverName, combinedNamespace, "demo-combined", "demo-combined-node", "driver-journal-combined.jsonl")
	if err != nil {
		return rep, err
	}
	defer closeCombined()
	rep.combined, rep.combinedPeakRSS, err = c.runCombined(ctx)
	if len(rep.combined) > 0 {
		c.combinedSummary(rep)
	}
	if err != nil {
		return rep, fmt.Errorf("combined: %w", err)
	}
	for _, h := range rep.combined {
		if h.exitCode != 0 || h.overlaps != 0 || h.done != h.all || h.standby != "combined-b" {
			return rep, errors.New("the combined handover was not clean (see the table)")
		}
	}
	return rep, nil
}

// setUp gives d a driver (journalling into the log folder), a namespace and the storage
// around them; the returned func closes the journal.
func (d *demo) setUp(ctx context.Context, driver, namespace, class, node, journalFile string) (func(), error) {
	journal, err := os.Create(filepath.Join(d.o.logDir, journalFile))
	if err != nil {
		return nil, err
	}
	d.driver, err = testdriver.New(testdriver.Config{DriverName: driver, Latency: d.o.latency, JournalWriter: journal})
	if err != nil {
		journal.Close()
		return nil, err
	}
	d.say("test CSI driver %s: every controller call takes %v", driver, d.o.latency)
	if _, err := d.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil {
		journal.Close()
		return nil, err
	}
	d.namespace = namespace
	d.store = e2e.Storage{Kube: d.kube, Namespace: namespace, Class: class, Node: node, Driver: driver}
	if err := d.store.SetUp(ctx, d.driver.NodeID()); err != nil {
		journal.Close()
		return nil, err
	}
	return func() { journal.Close() }, nil
}

func (d *demo) say(format string, args ...any) {
	fmt.Fprintf(d.out, "[%6.1fs] %s\n", time.Since(d.began).Seconds(), fmt.Sprintf(format, args...))
}

// startPair starts replica a of sidecar (a sidecar's name, or "combined") with args (the
// subcommand or --controllers, and the sidecar's own flags), waits until it holds every one
// of leases, then starts standby b.
func (d *demo) startPair(ctx context.Context, sidecar string, args, leases []string) error {
	for _, id := range []string{"a", "b"} {
		name := sidecar + "-" + id
		srv, err := d.driver.Serve(filepath.Join(d.o.logDir, name+".sock"))
		if err != nil {
			return err
		}
		r, err := startReplica(d.o.bin, args, name, srv.Endpoint(), d.cp.KubeconfigPath(), d.namespace, d.o.logDir)
		if err != nil {
			return err
		}
		r.sidecar = sidecar
		r.socket = srv.Socket() // the driver's journal names the socket, not the endpoint
		d.procs.add(r)
		if id == "a" {
			if err := d.waitFor(ctx, name+" leads", func() (bool, error) {
				for _, lease := range leases {
					if d.holder(ctx, lease) != name {
						return false, nil
					}
				}
				return true, nil
			}); err != nil {
				return err
			}
			if len(leases) == 1 {
				d.say("%s leads (Lease %s/%s)", name, d.namespace, leases[0])
			} else {
				d.say("%s leads all %d (Leases in %s: %s)", name, len(leases), d.namespace, strings.Join(leases, ", "))
			}
		} else {
			d.say("%s stands by with warm caches", name)
		}
	}
	return nil
}

// handover gives the leader work, SIGTERMs it while calls are in flight, and follows the
// standby until all work is done.
func (d *demo) handover(ctx context.Context, sidecar, lease, method string, work func(context.Context) error, done func(context.Context) (int, error)) (handover, error) {
	h := handover{sidecar: sidecar, method: method, all: d.o.volumes}
	leader, standby := d.pair(sidecar, d.holder(ctx, lease))
	if leader == nil {
		return h, fmt.Errorf("no replica of %s holds its Lease", sidecar)
	}
	h.leader, h.standby = leader.name, standby.name
	fmt.Fprintf(d.out, "\n== %s: %d volumes, leader %s, standby %s\n", sidecar, d.o.volumes, leader.name, standby.name)
	if err := work(ctx); err != nil {
		return h, err
	}
	if err := d.waitCalls(ctx, func(c []testdriver.Call) bool { return running(calls(c, leader.socket, method)) >= 2 }); err != nil {
		return h, err
	}
	h.inFlight = running(calls(d.driver.Journal(), leader.socket, method))
	signalled := time.Now()
	_ = leader.cmd.Process.Signal(syscall.SIGTERM)
	d.say("SIGTERM -> %s with %d %s calls in flight", leader.name, h.inFlight, method)
	select {
	case <-leader.done:
	case <-ctx.Done():
		return h, ctx.Err()
	}
	h.drain, h.exitCode = leader.exited.Sub(signalled), leader.code
	finished := calls(d.driver.Journal(), leader.socket, method)
	ok := 0
	for _, c := range finished {
		if c.Code == "OK" && c.CallerGone.IsZero() {
			ok++
		}
	}
	d.say("%s exited %d after draining %v: %d/%d of its calls completed, %d cancelled or failed", leader.name, h.exitCode, h.drain.Round(time.Millisecond), ok, len(finished), len(finished)-ok)
	if err := d.waitCalls(ctx, func(c []testdriver.Call) bool { return len(calls(c, standby.socket, method)) > 0 }); err != nil {
		return h, err
	}
	h.firstCallAfterExit = calls(d.driver.Journal(), standby.socket, method)[0].Start.Sub(leader.exited)
	d.say("%s took over: first %s %v after the leader exited", standby.name, method, h.firstCallAfterExit.Round(time.Millisecond))
	// Done when the API says so and the sidecar has no call of its own left running, so the
	// next phase starts on quiet volumes.
	err := d.waitFor(ctx, fmt.Sprintf("all %d volumes done", h.all), func() (bool, error) {
		n, err := done(ctx)
		h.done = n
		return n >= h.all && running(calls(d.driver.Journal(), standby.socket, method)) == 0, err
	})
	// Overlaps of this sidecar's own calls: two publishes, two expansions, ... of one volume
	// at once. Calls of different sidecars on one volume (publish while expanding) are
	// allowed by CSI and not counted.
	for _, o := range d.driver.Overlaps() {
		if o.First.Method == method && o.Second.Method == method {
			h.overlaps++
		}
	}
	h.standbyPeakRSS = peakRSS(standby.cmd.Process.Pid)
	d.say("%s: %d/%d done, %d overlapping operations in the driver", sidecar, h.done, h.all, h.overlaps)
	return h, err
}

func (d *demo) summary(results []handover) {
	fmt.Fprintln(d.out, "\nSummary (one SIGTERM per sidecar, calls in flight)")
	d.table(results, true)
	fmt.Fprintln(d.out, "(drain: SIGTERM to exit. The standby may start a few ms before the old process has exited: it")
	fmt.Fprintln(d.out, " takes over when the Lease is released, which is the old leader's last step; that shows as a negative time.)")
}

func (d *demo) pair(sidecar, leader string) (*replica, *replica) {
	var l, s *replica
	for _, r := range d.procs.all() {
		switch {
		case r.sidecar != sidecar:
		case r.name == leader:
			l = r
		default:
			s = r
		}
	}
	return l, s
}

func (d *demo) holder(ctx context.Context, lease string) string {
	l, err := d.kube.CoordinationV1().Leases(d.namespace).Get(ctx, lease, metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

// waitFor polls cond (API state has no cheaper signal here) for up to two minutes.
func (d *demo) waitFor(ctx context.Context, what string, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, err := cond()
		if err == nil && ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting until %s: %w (last error: %v)", what, ctx.Err(), err)
		case <-tick.C:
		}
	}
}

func (d *demo) waitCalls(ctx context.Context, cond func([]testdriver.Call) bool) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	return d.driver.WaitFor(ctx, cond)
}

func (d *demo) cleanUp() {
	for _, r := range d.procs.all() {
		r.kill()
	}
	if d.cp != nil {
		_ = d.cp.Stop()
	}
}

func (d *demo) createClaims(ctx context.Context) error {
	for i := range d.o.volumes {
		if err := d.store.CreateClaim(ctx, fmt.Sprintf("data-%02d", i)); err != nil {
			return err
		}
	}
	d.say("created %d PVCs of StorageClass %s", d.o.volumes, d.store.Class)
	return nil
}

func (d *demo) countProvisioned(ctx context.Context) (int, error) {
	pvs, err := d.store.Provisioned(ctx)
	return len(pvs), err
}

// bindAll plays kube-controller-manager's PV controller for the provisioned volumes.
func (d *demo) bindAll(ctx context.Context) error {
	n, err := d.store.BindAll(ctx)
	if err != nil {
		return err
	}
	d.say("bound %d PVCs to their PVs (standing in for kube-controller-manager)", n)
	return nil
}

func (d *demo) createAttachments(ctx context.Context) error {
	pvs, err := d.store.Provisioned(ctx)
	if err != nil {
		return err
	}
	for _, pv := range pvs {
		if err := d.store.CreateAttachment(ctx, pv.Name); err != nil {
			return err
		}
	}
	d.say("created %d VolumeAttachments for node %s (standing in for kube-controller-manager)", len(pvs), d.store.Node)
	return nil
}

func (d *demo) countAttached(ctx context.Context) (int, error) { return d.store.Attached(ctx) }

func (d *demo) expandClaims(ctx context.Context) error {
	for i := range d.o.volumes {
		if err := d.store.Expand(ctx, fmt.Sprintf("data-%02d", i), "2Gi"); err != nil {
			return err
		}
	}
	d.say("asked for 2Gi on %d PVCs", d.o.volumes)
	return nil
}

func (d *demo) countExpanded(ctx context.Context) (int, error) { return d.store.Expanded(ctx, "2Gi") }

func calls(all []testdriver.Call, socket, method string) []testdriver.Call {
	var out []testdriver.Call
	for _, c := range all {
		if c.Socket == socket && c.Method == method {
			out = append(out, c)
		}
	}
	return out
}

func running(cs []testdriver.Call) int {
	n := 0
	for _, c := range cs {
		if !c.Done() {
			n++
		}
	}
	return n
}

// peakRSS is a process's peak resident memory (VmHWM), 0 if unknown.
func peakRSS(pid int) int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}
