// Command demo is `make demo`: on one machine it starts a real kube-apiserver + etcd, the
// real control loop (kube-controller-manager and kube-scheduler, with fake Ready nodes), the
// test CSI driver with slow calls, the real snapshot-controller of external-snapshotter, and
// two replicas of each sidecar at upstream's default flags. It then acts as a user: Pods with
// WaitForFirstConsumer claims (kube-scheduler picks their nodes, the provisioner provisions,
// kube-controller-manager binds and creates the VolumeAttachments, the attacher attaches),
// the Pods replaced, the claims grown (kube-controller-manager hands them to the resizer) and
// snapshotted (the snapshot-controller creates a VolumeSnapshotContent for each
// VolumeSnapshot, the snapshotter takes it). It SIGTERMs each sidecar's leader while its calls
// are in flight and prints a live timeline and a summary of each handover. A pair of
// health-monitor replicas watches the volumes' health: one volume turns unhealthy in the
// driver and healthy again, and the claim shows both. Then the node side: a real kubelet,
// the driver's node service in its plugin folder and csi-sidecars
// --controllers=node-driver-registrar,livenessprobe, rolled out as a DaemonSet would with
// maxSurge and with maxUnavailable while a watch on CSINode times the driver's absence. With
// -combined it then does the same work with two replicas of one process running all four
// sidecars and the livenessprobe (csi-sidecars --controllers=...), which one SIGTERM hands
// over, and compares their memory.
// Everything it starts stops with it (also on Ctrl-C); the logs stay in the folder it names.
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
	"strings"
	"sync"
	"syscall"
	"time"

	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cluster"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/kubelet"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/procmem"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/snapshotcontroller"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

const (
	driverName    = "demo.csi.sidecars.io"
	demoNamespace = "demo"
	// The combined run has a driver of its own, so Leases, volumes and journal of the two
	// runs never mix.
	combinedDriverName = "combined.demo.csi.sidecars.io"
	combinedNamespace  = "demo-combined"
	controllers        = "--controllers=attacher,provisioner,resizer,snapshotter,livenessprobe"

	nodes      = 2
	nodePrefix = "demo-node"
	grownSize  = "2Gi"
	// waitTimeout bounds each wait for the sidecars or the control loop.
	waitTimeout = 2 * time.Minute
)

type options struct {
	short    bool   // CI mode: fewer Pods, shorter calls
	combined bool   // after the single-sidecar run, the combined one
	bin      string // the csi-sidecars binary
	logDir   string
	pods     int // Pods (and claims) per sidecar's handover
	latency  time.Duration
}

func main() {
	var o options
	flag.BoolVar(&o.short, "short", false, "fewer Pods and shorter calls (for CI)")
	flag.BoolVar(&o.combined, "combined", false, "then do the same work with two processes that each run all four sidecars and the livenessprobe ("+controllers+"), one SIGTERM for the four Leases")
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

// demo is one run: the cluster, the driver, the replicas, the user's workload and the
// timeline. The combined run is a copy with a driver, namespace and workload of its own.
type demo struct {
	o         options
	out       io.Writer
	began     time.Time
	kube      kubernetes.Interface
	cp        *controlplane.ControlPlane
	loop      *cluster.Cluster // kube-controller-manager, kube-scheduler and the nodes
	snapCtl   *snapshotcontroller.Controller
	snapAPI   snapclientset.Interface
	driver    *testdriver.Backend
	namespace string
	work      *cluster.Workload
	snaps     *snapshots // the run's VolumeSnapshotClass and VolumeSnapshots
	procs     *procs     // of both runs, so that every one is stopped at the end
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
	// combinedProbes are the status codes of the combined replicas' livenessprobes.
	combinedProbes map[string]int
	health         volumeHealth
	node           nodeReport
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
	o.pods, o.latency = 8, 3*time.Second
	if o.short {
		o.pods, o.latency = 4, time.Second
	}
	// Before anything starts: the control loop's binaries are built, or the error says how.
	assets, err := cluster.Assets()
	if err != nil {
		return rep, fmt.Errorf("the demo runs the real control loop: %w", err)
	}
	if _, err := snapshotcontroller.Assets(); err != nil {
		return rep, fmt.Errorf("the demo runs the real snapshot-controller: %w", err)
	}
	if _, err := kubelet.Assets(); err != nil {
		return rep, fmt.Errorf("the demo runs a real kubelet: %w", err)
	}
	// Sockets live in the log folder; gRPC needs their paths absolute.
	if o.logDir, err = filepath.Abs(o.logDir); err != nil {
		return rep, fmt.Errorf("log folder: %w", err)
	}
	if err := os.MkdirAll(o.logDir, 0o755); err != nil {
		return rep, fmt.Errorf("log folder: %w", err)
	}
	d := &demo{o: o, out: out, began: time.Now(), procs: &procs{}}
	defer func() {
		d.cleanUp()
		journals := "driver-journal.jsonl"
		if o.combined {
			journals += ", driver-journal-combined.jsonl"
		}
		fmt.Fprintf(out, "\nLogs: %s (one file per replica and node process, apiserver.log, etcd.log, %s.log, %s.log, %s.log, kubelet-%s.log, %s)\n",
			o.logDir, cluster.ControllerManagerBinary, cluster.SchedulerBinary, snapshotcontroller.Binary, kubeletNode, journals)
	}()

	// The claims' status.healthStatus is kept by kube-apiserver's alpha CSIVolumeHealth gate.
	d.say("starting kube-apiserver (feature gate CSIVolumeHealth on) + etcd on loopback")
	if d.cp, err = controlplane.Start(ctx, controlplane.Options{LogDir: o.logDir,
		APIServerArgs: []string{"--feature-gates=CSIVolumeHealth=true"}}); err != nil {
		return rep, fmt.Errorf("control plane: %w", err)
	}
	d.kube = kubernetes.NewForConfigOrDie(d.cp.Config())
	d.snapAPI = snapclientset.NewForConfigOrDie(d.cp.Config())
	// Before the sidecars: it installs the VolumeSnapshot CRDs, which the provisioner and
	// the snapshotter look for when they start. Its API budget is the e2e tests': at its
	// default (5/s, burst 10) its own client-side throttling held each new
	// VolumeSnapshotContent back by up to 0.6 s, so that the controller, not the sidecar,
	// decided when the snapshotter's standby got its first work.
	d.say("starting snapshot-controller %s (installing its VolumeSnapshot CRDs)", snapshotcontroller.Version)
	if d.snapCtl, err = snapshotcontroller.Start(ctx, d.cp, snapshotcontroller.Options{LogDir: o.logDir,
		Args: []string{"--kube-api-qps=100", "--kube-api-burst=200"}}); err != nil {
		return rep, err
	}
	closeRun, err := d.setUp(ctx, driverName, demoNamespace, "driver-journal.jsonl")
	if err != nil {
		return rep, err
	}
	defer closeRun()

	// The control loop starts while the replicas do.
	d.say("starting kube-controller-manager and kube-scheduler with %d fake Ready nodes", nodes)
	type started struct {
		loop *cluster.Cluster
		err  error
	}
	loop := make(chan started, 1)
	go func() {
		opts := cluster.Options{AssetsDir: assets, LogDir: o.logDir, Nodes: nodes, NodePrefix: nodePrefix,
			Driver: driverName, TopologyKey: testdriver.TopologyKey}
		if o.combined {
			opts.MoreDrivers = []string{combinedDriverName}
		}
		c, err := cluster.Start(ctx, d.cp, opts)
		loop <- started{c, err}
	}()
	// The same Pods go through the four phases: created, replaced, their claims grown and
	// snapshotted.
	sanitized, names := lifecycle.SanitizeName(driverName), podNames("app", o.pods)
	phases := []phase{
		d.provisioning(sanitized, names),
		d.rollout("external-attacher-leader-"+sanitized, names),
		d.growth("external-resizer-"+sanitized, names),
		d.snapshotting("external-snapshotter-leader-"+sanitized, names),
	}
	var pairsErr error
	for _, p := range phases {
		if pairsErr = d.startPair(ctx, p.sidecar, []string{p.sidecar}, []string{p.lease}, false); pairsErr != nil {
			break
		}
	}
	if pairsErr == nil {
		pairsErr = d.startPair(ctx, "health-monitor", []string{"health-monitor", listInterval, monitorInterval},
			[]string{"external-health-monitor-leader-" + sanitized}, false)
	}
	l := <-loop
	d.loop = l.loop
	if err := errors.Join(pairsErr, l.err); err != nil {
		return rep, err
	}
	d.say("kube-controller-manager and kube-scheduler serving; nodes %s Ready and schedulable", strings.Join(d.loop.Nodes(), ", "))

	for _, p := range phases {
		h, err := d.handover(ctx, p)
		rep.single = append(rep.single, h)
		if err != nil {
			d.summary(rep.single)
			return rep, fmt.Errorf("%s: %w", p.sidecar, err)
		}
		if p.sidecar == "provisioner" {
			if rep.health, err = d.volumeHealth(ctx, p.names[0]); err != nil {
				return rep, fmt.Errorf("volume health: %w", err)
			}
		}
	}
	d.summary(rep.single)
	for _, h := range rep.single {
		if h.exitCode != 0 || h.overlaps != 0 || h.done != h.all {
			return rep, errors.New("a handover was not clean (see the table)")
		}
	}
	// The single-sidecar replicas are done; stopped, they leave the machine's cores to the
	// node part and the combined run.
	for _, r := range d.procs.all() {
		r.kill()
	}
	rep.node, err = d.nodePart(ctx)
	if len(rep.node.rollouts) > 0 {
		d.nodeSummary(rep.node)
	}
	if err != nil {
		return rep, fmt.Errorf("node: %w", err)
	}
	if !rep.node.clean() {
		return rep, errors.New("a node rollout was not clean (see the table)")
	}
	if !o.combined {
		return rep, nil
	}

	fmt.Fprintf(d.out, "\n== combined: csi-sidecars %s, two replicas, %d Pods\n", controllers, o.pods)
	c := *d
	closeCombined, err := c.setUp(ctx, combinedDriverName, combinedNamespace, "driver-journal-combined.jsonl")
	if err != nil {
		return rep, err
	}
	defer closeCombined()
	rep.combined, rep.combinedPeakRSS, rep.combinedProbes, err = c.runCombined(ctx)
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

// setUp gives d a driver (journalling into the log folder), a namespace and the user's
// workload in it; the returned func stops the workload and closes the journal.
func (d *demo) setUp(ctx context.Context, driver, namespace, journalFile string) (func(), error) {
	journal, err := os.Create(filepath.Join(d.o.logDir, journalFile))
	if err != nil {
		return nil, fmt.Errorf("driver journal: %w", err)
	}
	d.driver, err = testdriver.New(testdriver.Config{DriverName: driver, Topology: true, Latency: d.o.latency, JournalWriter: journal,
		ControllerCapabilities: append(snapshotCapabilities(), healthCapabilities()...)})
	if err != nil {
		journal.Close()
		return nil, fmt.Errorf("test CSI driver: %w", err)
	}
	d.say("test CSI driver %s: every controller call takes %v (CreateSnapshot too)", driver, d.o.latency)
	if _, err := d.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil {
		journal.Close()
		return nil, fmt.Errorf("namespace %s: %w", namespace, err)
	}
	d.namespace = namespace
	if d.work, err = cluster.NewWorkload(ctx, d.kube, cluster.WorkloadOptions{Namespace: namespace, Driver: driver}); err != nil {
		journal.Close()
		return nil, err
	}
	if d.snaps, err = newSnapshots(ctx, d.snapAPI, driver, namespace); err != nil {
		d.work.Close()
		journal.Close()
		return nil, err
	}
	work := d.work
	return func() {
		work.Close()
		journal.Close()
	}, nil
}

func (d *demo) say(format string, args ...any) {
	fmt.Fprintf(d.out, "[%6.1fs] %s\n", time.Since(d.began).Seconds(), fmt.Sprintf(format, args...))
}

// startPair starts replica a of sidecar (a sidecar's name, or "combined") with args (the
// subcommand or --controllers; every other flag at its default), waits until it holds every
// one of leases, then starts standby b. With probe, each hosts the livenessprobe on a port
// of its own.
func (d *demo) startPair(ctx context.Context, sidecar string, args, leases []string, probe bool) error {
	for _, id := range []string{"a", "b"} {
		name := sidecar + "-" + id
		srv, err := d.driver.Serve(filepath.Join(d.o.logDir, name+".sock"))
		if err != nil {
			return fmt.Errorf("driver socket of %s: %w", name, err)
		}
		r, err := startReplica(d.o.bin, args, name, srv.Endpoint(), d.cp.KubeconfigPath(), d.namespace, d.o.logDir, probe)
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
			ctx, cancel := context.WithTimeout(ctx, waitTimeout)
			err := r.waitReady(ctx, true)
			cancel()
			if err != nil {
				return err
			}
			d.say("%s stands by with warm caches", name)
		}
	}
	return nil
}

// phase is one sidecar's handover in the single-sidecar run: a user's work in two waves,
// the first before the leader's SIGTERM and the second while it drains, so that the
// standby has work waiting the moment it takes over.
type phase struct {
	sidecar, lease, method string
	title                  string // what the work is, for the heading
	names                  []string
	// prepare readies the Pods for the work (optional).
	prepare func(context.Context) error
	// give hands a wave of the Pods to the control loop and says what it did.
	give func(ctx context.Context, names []string) (string, error)
	// how says how the control loop brings the first wave to the sidecar, after what give
	// said.
	how string
	// stage is where a Pod is once the sidecar has done its work.
	stage cluster.Stage
	// wait and count replace stage for work that is no stage of a Pod (VolumeSnapshots):
	// wait until all of names is done, count how many are.
	wait  func(ctx context.Context, names []string) error
	count func(names []string) int
}

// waitDone waits, for up to waitTimeout, until the phase's work on names is done.
func (d *demo) waitDone(ctx context.Context, p phase, names []string) error {
	if p.wait != nil {
		return p.wait(ctx, names)
	}
	return d.waitStage(ctx, p.stage, names)
}

// doneCount counts the names whose work is done.
func (d *demo) doneCount(p phase, names []string) int {
	if p.count != nil {
		return p.count(names)
	}
	return d.reached(p.stage, names)
}

// provisioning: new Pods, each with a new claim; kube-scheduler picks their nodes and the
// provisioner provisions the claims there.
func (d *demo) provisioning(lease string, names []string) phase {
	return phase{
		sidecar: "provisioner", lease: lease, method: testdriver.MethodCreateVolume,
		title: fmt.Sprintf("%d Pods, each with a new claim", len(names)),
		names: names,
		give: func(ctx context.Context, names []string) (string, error) {
			for _, name := range names {
				if err := d.work.CreatePod(ctx, name); err != nil {
					return "", err
				}
			}
			return "created Pods " + span(names), nil
		},
		how: fmt.Sprintf(", each with a new claim of StorageClass %s (WaitForFirstConsumer): kube-scheduler picks a node for each, the provisioner provisions there",
			d.work.Class()),
		stage: cluster.Provisioned,
	}
}

// rollout: the Pods are replaced. Once their volumes are attached (by the attacher's leader,
// before any SIGTERM), the Pods are deleted and their volumes detached; created again,
// kube-controller-manager attaches each volume anew.
func (d *demo) rollout(lease string, names []string) phase {
	return phase{
		sidecar: "attacher", lease: lease, method: testdriver.MethodControllerPublishVolume,
		title: fmt.Sprintf("the %d Pods replaced", len(names)),
		names: names,
		prepare: func(ctx context.Context) error {
			if err := d.waitStage(ctx, cluster.Attached, names); err != nil {
				return err
			}
			d.say("kube-controller-manager bound the %d claims, kube-scheduler the Pods (%s); their volumes were attached",
				len(names), d.perNode(names))
			for _, name := range names {
				if err := d.work.DeletePod(ctx, name); err != nil {
					return err
				}
			}
			if err := d.waitStage(ctx, cluster.Detached, names); err != nil {
				return err
			}
			d.say("deleted the %d Pods; kube-controller-manager had their volumes detached", len(names))
			return nil
		},
		give: func(ctx context.Context, names []string) (string, error) {
			for _, name := range names {
				if err := d.work.RecreatePod(ctx, name); err != nil {
					return "", err
				}
			}
			return "created Pods " + span(names) + " again", nil
		},
		how:   ": kube-scheduler puts each on its volume's node, kube-controller-manager creates a VolumeAttachment for each volume",
		stage: cluster.Attached,
	}
}

// growth: the claims, in use, are grown; kube-controller-manager hands them to the resizer.
func (d *demo) growth(lease string, names []string) phase {
	return phase{
		sidecar: "resizer", lease: lease, method: testdriver.MethodControllerExpandVolume,
		title: fmt.Sprintf("the %d claims grown to %s while in use", len(names), grownSize),
		names: names,
		give: func(ctx context.Context, names []string) (string, error) {
			for _, name := range names {
				if err := d.work.Grow(ctx, name, grownSize); err != nil {
					return "", err
				}
			}
			return fmt.Sprintf("asked for %s on claims %s", grownSize, span(names)), nil
		},
		how:   ": kube-controller-manager hands them to the resizer",
		stage: cluster.Grown,
	}
}

// handover gives the leader the first wave of the phase's work, SIGTERMs it while calls are
// in flight, gives the second wave while it drains, and follows the standby until all the
// work is done.
func (d *demo) handover(ctx context.Context, p phase) (handover, error) {
	h := handover{sidecar: p.sidecar, method: p.method, all: len(p.names)}
	leader, standby := d.pair(p.sidecar, d.holder(ctx, p.lease))
	if leader == nil || standby == nil {
		return h, fmt.Errorf("no replica of %s holds its Lease, or it has no standby", p.sidecar)
	}
	h.leader, h.standby = leader.name, standby.name
	fmt.Fprintf(d.out, "\n== %s: %s, leader %s, standby %s\n", p.sidecar, p.title, leader.name, standby.name)
	if p.prepare != nil {
		if err := p.prepare(ctx); err != nil {
			return h, err
		}
	}
	first, second := p.names[:len(p.names)/2], p.names[len(p.names)/2:]
	since := time.Now()
	what, err := p.give(ctx, first)
	if err != nil {
		return h, err
	}
	d.say("%s%s", what, p.how)
	if err := d.waitCalls(ctx, func(c []testdriver.Call) bool { return inFlight(c, leader.socket, p.method, since, len(first)) }); err != nil {
		return h, fmt.Errorf("waiting for %s calls of %s: %w", p.method, leader.name, err)
	}
	signalled, err := d.terminate(ctx, leader)
	if err != nil {
		return h, err
	}
	h.inFlight = runningAt(callsSince(d.driver.Journal(), leader.socket, p.method, since), signalled)
	d.say("SIGTERM -> %s with %d %s calls in flight", leader.name, h.inFlight, p.method)
	if what, err = p.give(ctx, second); err != nil {
		return h, err
	}
	d.say("%s while %s drains", what, leader.name)
	select {
	case <-leader.done:
	case <-ctx.Done():
		return h, ctx.Err()
	}
	h.drain, h.exitCode = leader.exited.Sub(signalled), leader.code
	finished := callsSince(d.driver.Journal(), leader.socket, p.method, since)
	ok := 0
	for _, c := range finished {
		if c.Code == "OK" && c.CallerGone.IsZero() {
			ok++
		}
	}
	d.say("%s exited %d after draining %v: %d/%d of its calls completed, %d cancelled or failed", leader.name, h.exitCode, h.drain.Round(time.Millisecond), ok, len(finished), len(finished)-ok)
	if err := d.waitCalls(ctx, func(c []testdriver.Call) bool { return len(callsSince(c, standby.socket, p.method, since)) > 0 }); err != nil {
		return h, fmt.Errorf("waiting for %s's first %s: %w", standby.name, p.method, err)
	}
	h.firstCallAfterExit = callsSince(d.driver.Journal(), standby.socket, p.method, since)[0].Start.Sub(leader.exited)
	d.say("%s took over: first %s %v after the leader exited", standby.name, p.method, h.firstCallAfterExit.Round(time.Millisecond))
	// Done when all the work is (every Pod reached the stage) and the sidecar has no call
	// of its own left running, so the next phase starts on quiet volumes.
	err = d.waitDone(ctx, p, p.names)
	if err == nil {
		err = d.waitCalls(ctx, func(c []testdriver.Call) bool { return running(callsSince(c, standby.socket, p.method, since)) == 0 })
	}
	h.done = d.doneCount(p, p.names)
	h.overlaps = d.overlaps(p.method)
	h.standbyPeakRSS = procmem.Peak(standby.cmd.Process.Pid)
	d.say("%s: %d/%d done, %d overlapping operations in the driver", p.sidecar, h.done, h.all, h.overlaps)
	return h, err
}

// terminate SIGTERMs the leader and returns when it was sent, once the leader has stopped
// taking work: work given after that is the standby's, also on a machine so busy that the
// leader takes a while to act on the signal.
func (d *demo) terminate(ctx context.Context, leader *replica) (time.Time, error) {
	signalled := time.Now()
	if err := leader.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return signalled, fmt.Errorf("SIGTERM to %s: %w", leader.name, err)
	}
	ctx, cancel := context.WithTimeout(ctx, waitTimeout)
	defer cancel()
	return signalled, leader.waitReady(ctx, false)
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

// waitFor polls cond (a Lease has no cheaper signal here) for up to waitTimeout.
func (d *demo) waitFor(ctx context.Context, what string, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, waitTimeout)
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

// waitCalls waits, for up to waitTimeout, until cond holds for the driver's journal.
func (d *demo) waitCalls(ctx context.Context, cond func([]testdriver.Call) bool) error {
	ctx, cancel := context.WithTimeout(ctx, waitTimeout)
	defer cancel()
	return d.driver.WaitFor(ctx, cond)
}

// waitStage waits, for up to waitTimeout, until every named Pod reached stage; the error
// says where each Pod still waiting stands.
func (d *demo) waitStage(ctx context.Context, stage cluster.Stage, names []string) error {
	ctx, cancel := context.WithTimeout(ctx, waitTimeout)
	defer cancel()
	return d.work.Wait(ctx, stage, names...)
}

// reached counts the named Pods that reached stage.
func (d *demo) reached(stage cluster.Stage, names []string) int {
	n := 0
	for _, name := range names {
		if it, ok := d.work.Item(name); ok && !it.Times[stage].IsZero() {
			n++
		}
	}
	return n
}

// perNode says how many of the named Pods each node has, as "demo-node-0: 3, ...".
func (d *demo) perNode(names []string) string {
	count := map[string]int{}
	for _, name := range names {
		it, _ := d.work.Item(name)
		count[it.Node]++
	}
	var parts []string
	for _, node := range d.loop.Nodes() {
		parts = append(parts, fmt.Sprintf("%s: %d", node, count[node]))
	}
	return strings.Join(parts, ", ")
}

// overlaps counts the driver's overlapping operations of one method: two publishes, two
// expansions, ... of one volume at once. Calls of different sidecars on one volume (publish
// while expanding) are allowed by CSI and not counted.
func (d *demo) overlaps(method string) int {
	n := 0
	for _, o := range d.driver.Overlaps() {
		if o.First.Method == method && o.Second.Method == method {
			n++
		}
	}
	return n
}

func (d *demo) cleanUp() {
	for _, r := range d.procs.all() {
		r.kill()
	}
	if err := d.loop.Stop(); err != nil {
		fmt.Fprintf(d.out, "stopping kube-controller-manager and kube-scheduler: %v\n", err)
	}
	if err := d.snapCtl.Stop(); err != nil {
		fmt.Fprintf(d.out, "stopping snapshot-controller: %v\n", err)
	}
	if d.cp != nil {
		_ = d.cp.Stop()
	}
}

// podNames are prefix-00, prefix-01, ...
func podNames(prefix string, n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("%s-%02d", prefix, i)
	}
	return names
}

// span is names as "first..last".
func span(names []string) string {
	if len(names) == 1 {
		return names[0]
	}
	return names[0] + ".." + names[len(names)-1]
}

// inFlight says whether a SIGTERM to the replica on socket now catches its calls of method
// (those started since) in flight: two or more, or at least one once as many have started
// as the wave has items (calls that came one by one).
func inFlight(journal []testdriver.Call, socket, method string, since time.Time, wave int) bool {
	cs := callsSince(journal, socket, method, since)
	n := running(cs)
	return n >= 2 || (n >= 1 && len(cs) >= wave)
}

// callsSince are the calls of method on socket that started at or after since.
func callsSince(all []testdriver.Call, socket, method string, since time.Time) []testdriver.Call {
	var out []testdriver.Call
	for _, c := range all {
		if c.Socket == socket && c.Method == method && !c.Start.Before(since) {
			out = append(out, c)
		}
	}
	return out
}

// runningAt counts the calls that had not ended at t. Asked once a leader has stopped taking
// work, these are the calls it was SIGTERMed with at t (those that started between the
// signal and its stop included), which its drain lets finish.
func runningAt(cs []testdriver.Call, t time.Time) int {
	n := 0
	for _, c := range cs {
		if !c.Done() || c.End.After(t) {
			n++
		}
	}
	return n
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
