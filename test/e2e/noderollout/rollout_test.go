package noderollout

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/kubelet"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/regsocket"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

const (
	// stepTimeout bounds each wait of a scenario: a registrar's start or exit, the driver's
	// first registration, one renewal of the node's Lease (every 10 s).
	stepTimeout = 60 * time.Second
	// windowRenewals is how many renewals of the node's Lease a scenario watches CSINode
	// for after its last step: the kubelet's plugin manager reconciles every second, so a
	// driver that is still missing after these (10 to 20 s) is not coming back on its own.
	windowRenewals = 2
	pollEvery      = 20 * time.Millisecond
)

// implementation is a node-driver-registrar, run as the container of a pod of the node's
// DaemonSet.
type implementation struct {
	name  string // in the table
	short string // in driver and test names
	// command is the binary and what goes before the flags.
	command func() []string
}

var (
	ours = implementation{name: "ours", short: "ours", command: func() []string {
		return []string{filepath.Join(binDir, "csi-sidecars"), "node-driver-registrar", "-v=2"}
	}}
	upstreamModel = implementation{name: "upstream model", short: "model", command: func() []string {
		return []string{modelBin}
	}}
	implementations = []implementation{ours, upstreamModel}
)

// scenario is what happens to a node's registrars once the first one, A, has registered
// the driver.
type scenario struct {
	key, name string
	act       func(w *world)
}

var (
	maxUnavailable = scenario{"a", "rollout, maxUnavailable: A stopped, then B started", func(w *world) {
		w.term(w.first)
		w.started(w.start("B"))
	}}
	maxSurge = scenario{"b", "rollout, maxSurge: B started beside A, then A stopped", func(w *world) {
		w.started(w.start("B"))
		w.term(w.first)
	}}
	twoPods = scenario{"c", "two pods on one node, the older deleted (aws-ebs-csi-driver #2812)", func(w *world) {
		w.started(w.start("B"))
		// Both run for a while: the kubelet has seen whatever B did.
		w.leaseRenewals(1)
		w.term(w.first)
	}}
	socketRemoved = scenario{"d", "registration socket removed by another process", func(w *world) {
		if err := os.Remove(w.regPath); err != nil {
			w.tb.Fatalf("removing the registration socket: %v", err)
		}
	}}
	scenarios = []scenario{maxUnavailable, maxSurge, twoPods, socketRemoved}
)

// node is the kubelet the scenarios share: each has a driver of its own.
type node struct {
	k      *kubelet.Kubelet
	client kubernetes.Interface
}

func startNode(tb testing.TB) *node {
	tb.Helper()
	e2e.RequireBinaries(tb, binDir)
	if _, err := kubelet.Assets(); err != nil {
		tb.Skip(err)
	}
	cp := kube.Get(tb)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	return &node{k: kubelet.Start(ctx, tb, cp, kubelet.Options{}), client: kubernetes.NewForConfigOrDie(cp.Config())}
}

// world is one scenario's run: a driver of its own on the node, its registrars and the
// watch on CSINode.
type world struct {
	tb         testing.TB
	ctx        context.Context
	n          *node
	im         implementation
	driver     *testdriver.Backend
	driverSock string
	regPath    string
	// nextPath is where csi-sidecars' registrar offers the handover of its socket.
	nextPath   string
	watch      *kubelet.Presence
	first      *registrar
	registrars []*registrar
	logDir     string
}

// registrar is one pod's registrar process.
type registrar struct {
	name  string
	child *controlplane.Child
}

func (r *registrar) running() bool {
	select {
	case <-r.child.Done():
		return false
	default:
		return true
	}
}

// result is what one run of a scenario measured.
type result struct {
	absences []kubelet.Absence
	absent   time.Duration
	// cameBack: the driver is in CSINode at the end of the watch.
	cameBack bool
	// unlinked: a registrar still running serves a socket whose file is gone.
	unlinked bool
}

func (r result) String() string {
	var spans []string
	for _, s := range r.absences {
		spans = append(spans, s.To.Sub(s.From).Round(time.Millisecond).String())
	}
	return fmt.Sprintf("absent %d time(s) [%s], %.3f s in all; came back: %s; a registrar left serving an unlinked socket: %s",
		len(r.absences), strings.Join(spans, " "), r.absent.Seconds(), yesNo(r.cameBack), yesNo(r.unlinked))
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// runScenario runs sc with im on n: a driver named after both (and suffix), registrar A
// until the driver is in CSINode, sc's steps, then windowRenewals renewals of the node's
// Lease of watching.
func runScenario(tb testing.TB, n *node, sc scenario, im implementation, suffix string) result {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	tb.Cleanup(cancel)
	name := fmt.Sprintf("%s-%s%s.rollout.test", sc.key, im.short, suffix)
	backend, err := testdriver.New(testdriver.Config{DriverName: name, NodeID: "id-" + n.k.NodeName()})
	if err != nil {
		tb.Fatal(err)
	}
	dir := filepath.Join(n.k.PluginsDir(), name)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		tb.Fatal(err)
	}
	srv, err := backend.Serve(filepath.Join(dir, "csi.sock"))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(srv.Stop)
	w := &world{
		tb: tb, ctx: ctx, n: n, im: im, driver: backend, driverSock: srv.Socket(),
		regPath:  filepath.Join(n.k.RegistrationDir(), name+"-reg.sock"),
		nextPath: filepath.Join(n.k.RegistrationDir(), "."+name+"-reg.next"),
		logDir:   tb.TempDir(),
	}
	if w.watch, err = kubelet.WatchDriver(ctx, n.client, n.k.NodeName(), name); err != nil {
		tb.Fatal(err)
	}
	// Last, so first at cleanup: no registrar left, then no socket (a registrar still
	// running would place it again).
	tb.Cleanup(w.cleanup)
	w.first = w.start("A")
	w.started(w.first)
	w.waitPresent()
	sc.act(w)
	w.leaseRenewals(windowRenewals)
	end := time.Now()
	r := result{absences: w.watch.Absences(end), cameBack: w.watch.IsPresent()}
	r.absent = kubelet.Absent(r.absences)
	for _, p := range w.registrars {
		if !p.running() {
			continue
		}
		v, err := regsocket.Of(p.child.Pid(), w.regPath, w.nextPath)
		if err != nil {
			tb.Fatalf("registrar %s: %v", p.name, err)
		}
		r.unlinked = r.unlinked || v.Unlinked
	}
	return r
}

// start runs a registrar as pod name's container.
func (w *world) start(name string) *registrar {
	w.tb.Helper()
	cmd := w.im.command()
	args := append(cmd[1:],
		"--csi-address="+w.driverSock,
		"--kubelet-registration-path="+w.driverSock,
		"--plugin-registration-path="+w.n.k.RegistrationDir(),
	)
	child, err := controlplane.StartChild(cmd[0], filepath.Join(w.logDir, name+".log"), args...)
	if err != nil {
		w.tb.Fatal(err)
	}
	p := &registrar{name: name, child: child}
	w.registrars = append(w.registrars, p)
	return p
}

// started waits until p serves the registration socket, or waits beside the registrar
// that serves it to be handed it: it asked the driver its name and did what it does with
// the socket at start.
func (w *world) started(p *registrar) {
	w.tb.Helper()
	w.waitUntil("registrar "+p.name+" serves the registration socket or waits beside the one that does", func() (bool, error) {
		if !p.running() {
			return false, fmt.Errorf("registrar %s exited: %v; log:\n%s", p.name, p.child.Err(), p.child.LogTail(20))
		}
		v, err := regsocket.Of(p.child.Pid(), w.regPath, w.nextPath)
		return v.Serves || v.WaitsBeside, err
	})
}

// term sends SIGTERM to p, as the kubelet does when its pod is deleted, and waits for it
// to exit.
func (w *world) term(p *registrar) {
	w.tb.Helper()
	if err := syscall.Kill(p.child.Pid(), syscall.SIGTERM); err != nil {
		w.tb.Fatalf("SIGTERM to registrar %s: %v", p.name, err)
	}
	select {
	case <-p.child.Done():
	case <-time.After(stepTimeout):
		w.tb.Fatalf("registrar %s did not exit within %v of SIGTERM", p.name, stepTimeout)
	}
}

// waitPresent waits until the driver is in CSINode.
func (w *world) waitPresent() {
	w.tb.Helper()
	w.waitUntil("the driver is in CSINode", func() (bool, error) { return w.watch.IsPresent(), nil })
}

// leaseRenewals waits for the kubelet to renew its node's Lease n times.
func (w *world) leaseRenewals(n int) {
	w.tb.Helper()
	leases := w.n.client.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	var last *metav1.MicroTime
	for i := 0; i <= n; i++ {
		w.waitUntil(fmt.Sprintf("renewal %d of the node's Lease", i), func() (bool, error) {
			l, err := leases.Get(w.ctx, w.n.k.NodeName(), metav1.GetOptions{})
			if err != nil || l.Spec.RenewTime == nil {
				return false, nil
			}
			if last == nil || !l.Spec.RenewTime.Equal(last) {
				last = l.Spec.RenewTime
				return true, nil
			}
			return false, nil
		})
	}
}

func (w *world) waitUntil(what string, cond func() (bool, error)) {
	w.tb.Helper()
	err := wait.PollUntilContextTimeout(w.ctx, pollEvery, stepTimeout, true, func(context.Context) (bool, error) { return cond() })
	if err != nil {
		w.tb.Fatalf("%s (%s): %v", what, w.im.name, err)
	}
}

func (w *world) cleanup() {
	for _, p := range w.registrars {
		if err := p.child.Stop(); err != nil {
			w.tb.Error(err)
		}
		if w.tb.Failed() {
			w.tb.Logf("--- registrar %s (%s) ---\n%s", p.name, w.im.name, p.child.LogTail(40))
		}
	}
	for _, f := range []string{w.regPath, w.nextPath} {
		if err := os.Remove(f); err != nil && !os.IsNotExist(err) {
			w.tb.Error(err)
		}
	}
}

// TestDriverRegistrationThroughRollouts runs the scenarios whose outcome is a property of
// the registrar: with csi-sidecars', the driver never leaves CSINode when a registrar
// starts beside another (maxSurge, two pods), and comes back on its own after a
// maxUnavailable rollout and after its socket was removed; with the model of upstream's,
// the driver does not come back once the older of two pods is deleted (the reported bug).
// No figure of time is asserted.
func TestDriverRegistrationThroughRollouts(t *testing.T) {
	n := startNode(t)
	neverAbsent := func(t *testing.T, r result) {
		if len(r.absences) > 0 {
			t.Errorf("the driver left CSINode: %s", r)
		}
	}
	cameBack := func(t *testing.T, r result) {
		if !r.cameBack {
			t.Errorf("the driver did not come back to CSINode: %s", r)
		}
	}
	staysAway := func(t *testing.T, r result) {
		if len(r.absences) == 0 || r.cameBack {
			t.Errorf("the driver is in CSINode; the model of upstream's should have lost it: %s", r)
		}
	}
	cases := []struct {
		sc    scenario
		im    implementation
		check func(*testing.T, result)
	}{
		{maxUnavailable, ours, cameBack},
		{maxSurge, ours, neverAbsent},
		{twoPods, ours, neverAbsent},
		{socketRemoved, ours, cameBack},
		{twoPods, upstreamModel, staysAway},
	}
	// All at once, each with a driver of its own: they mostly wait for the kubelet, and
	// -parallel (GOMAXPROCS by default) would run two at a time.
	var wg sync.WaitGroup
	for _, c := range cases {
		wg.Go(func() {
			t.Run(c.sc.key+"-"+c.im.short, func(t *testing.T) {
				r := runScenario(t, n, c.sc, c.im, "")
				t.Logf("%s, %s: %s", c.sc.name, c.im.name, r)
				c.check(t, r)
			})
		})
	}
	wg.Wait()
}
