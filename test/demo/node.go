package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/kubelet"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/regsocket"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

const (
	// kubeletNode is the real kubelet's Node, apart from the control loop's fake nodes.
	kubeletNode     = "demo-kubelet"
	nodeControllers = "--controllers=node-driver-registrar,livenessprobe"
	// watchWindow is how long CSINode is watched after a rollout's last step: the kubelet's
	// plugin manager acts on a change of the registration socket within a second.
	watchWindow = 5 * time.Second
)

// nodeReport is what the node part saw.
type nodeReport struct {
	node         string
	kubeletReady time.Duration // from the kubelet's start to its Node Ready
	registered   time.Duration // from the first node process's start to the driver in CSINode
	nodeID       string        // the driver's node ID in CSINode
	topologyKeys []string      // the driver's topology keys in CSINode
	probeCode    int           // what the first node process's livenessprobe answered
	rollouts     []nodeRollout
}

// nodeRollout is one rollout of the node DaemonSet's pod on the kubelet's node.
type nodeRollout struct {
	strategy, steps string
	old, new        string
	exitCode        int // the old process's, after its SIGTERM
	absences        []kubelet.Absence
	absent          time.Duration
	// registrations are the kubelet's registrations of the driver during the rollout (its
	// NodeGetInfo calls).
	registrations int
	present       bool // the driver is in CSINode at the end
}

// clean: every old process exited 0, the driver is in CSINode after each rollout, and a
// maxSurge rollout never took it out.
func (r nodeReport) clean() bool {
	for _, ro := range r.rollouts {
		if ro.exitCode != 0 || !ro.present || (ro.strategy == "maxSurge" && len(ro.absences) > 0) {
			return false
		}
	}
	return true
}

// nodeSide is the node part's kubelet, the driver's node service and the registration
// socket's paths.
type nodeSide struct {
	*demo
	k                 *kubelet.Kubelet
	driver            *testdriver.Backend
	socket            string // the driver's node socket
	regPath, nextPath string
	procs             []*replica
}

// nodePart runs a kubelet, the driver's node service in its plugin folder, and the node
// DaemonSet's pod as one combined process; it shows the driver registered and the probe
// answering, then rolls the pod out with maxSurge and with maxUnavailable.
func (d *demo) nodePart(ctx context.Context) (rep nodeReport, err error) {
	fmt.Fprintf(d.out, "\n== node: a real kubelet (hollow-kubelet) as Node %s, the driver's node service in its plugin folder, csi-sidecars %s as the node DaemonSet's pod\n",
		kubeletNode, nodeControllers)
	began := time.Now()
	k, err := kubelet.Run(ctx, d.cp, kubelet.Options{NodeName: kubeletNode, LogDir: d.o.logDir})
	if k != nil {
		defer func() {
			if err := k.Close(); err != nil {
				fmt.Fprintf(d.out, "stopping the kubelet: %v\n", err)
			}
		}()
	}
	if err != nil {
		return rep, err
	}
	rep.node, rep.kubeletReady = k.NodeName(), time.Since(began)
	d.say("kubelet %s Ready %v after its start; it registers the CSI drivers whose sockets appear in %s",
		rep.node, rep.kubeletReady.Round(time.Millisecond), k.RegistrationDir())

	// The node service: the demo driver's name and topology, the node's own ID.
	driver, err := testdriver.New(testdriver.Config{DriverName: driverName, NodeID: rep.node, Topology: true})
	if err != nil {
		return rep, fmt.Errorf("test CSI driver: %w", err)
	}
	dir := filepath.Join(k.PluginsDir(), driverName)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return rep, fmt.Errorf("plugin folder: %w", err)
	}
	srv, err := driver.Serve(filepath.Join(dir, "csi.sock"))
	if err != nil {
		return rep, fmt.Errorf("driver's node socket: %w", err)
	}
	defer srv.Stop()
	n := &nodeSide{demo: d, k: k, driver: driver, socket: srv.Socket(),
		regPath:  filepath.Join(k.RegistrationDir(), driverName+"-reg.sock"),
		nextPath: filepath.Join(k.RegistrationDir(), "."+driverName+"-reg.next")}
	defer func() {
		for _, p := range n.procs {
			p.kill()
		}
	}()
	d.say("driver %s: node service at %s (node ID %s, topology %s=%s)", driverName, n.socket, rep.node, testdriver.TopologyKey, rep.node)

	watchCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	watch, err := kubelet.WatchDriver(watchCtx, d.kube, rep.node, driverName)
	if err != nil {
		return rep, err
	}
	a, err := n.start("node-a")
	if err != nil {
		return rep, err
	}
	if err := d.waitFor(ctx, "the driver is in CSINode "+rep.node, func() (bool, error) { return watch.IsPresent(), nil }); err != nil {
		return rep, err
	}
	rep.registered = time.Since(a.started)
	csiNode, err := d.kube.StorageV1().CSINodes().Get(ctx, rep.node, metav1.GetOptions{})
	if err != nil {
		return rep, fmt.Errorf("CSINode %s: %w", rep.node, err)
	}
	for _, dr := range csiNode.Spec.Drivers {
		if dr.Name == driverName {
			rep.nodeID, rep.topologyKeys = dr.NodeID, dr.TopologyKeys
		}
	}
	d.say("node-a placed %s; the kubelet registered the driver: in CSINode %s %v after node-a started (node ID %s, topology keys %s)",
		n.regPath, rep.node, rep.registered.Round(time.Millisecond), rep.nodeID, strings.Join(rep.topologyKeys, ","))
	probeCtx, probeCancel := context.WithTimeout(ctx, waitTimeout)
	rep.probeCode, err = a.waitProbe(probeCtx)
	probeCancel()
	if err != nil {
		return rep, err
	}
	d.say("node-a's livenessprobe answers %d on %s (the driver's Probe)", rep.probeCode, a.probe)

	surge, err := n.rollout(ctx, "maxSurge", "new pod started beside the old, then the old SIGTERMed", a, "node-b", true)
	rep.rollouts = append(rep.rollouts, surge)
	if err != nil {
		return rep, fmt.Errorf("maxSurge rollout: %w", err)
	}
	b := n.procs[len(n.procs)-1]
	unavailable, err := n.rollout(ctx, "maxUnavailable", "old pod SIGTERMed and gone, then the new started", b, "node-c", false)
	rep.rollouts = append(rep.rollouts, unavailable)
	if err != nil {
		return rep, fmt.Errorf("maxUnavailable rollout: %w", err)
	}
	return rep, nil
}

// start runs the node DaemonSet pod's process, name.
func (n *nodeSide) start(name string) (*replica, error) {
	r, err := startProcess(n.o.bin, []string{nodeControllers,
		"--csi-address=" + n.socket,
		"--node-driver-registrar-kubelet-registration-path=" + n.socket,
		"--node-driver-registrar-plugin-registration-path=" + n.k.RegistrationDir(),
	}, name, n.o.logDir, true)
	if err != nil {
		return nil, err
	}
	r.sidecar = "node"
	n.procs = append(n.procs, r)
	n.demo.procs.add(r)
	return r, nil
}

// view is what process r does with the registration socket.
func (n *nodeSide) view(r *replica) (regsocket.View, error) {
	if !r.running() {
		return regsocket.View{}, fmt.Errorf("%s exited with %d", r.name, r.code)
	}
	return regsocket.Of(r.cmd.Process.Pid, n.regPath, n.nextPath)
}

// rollout replaces the node pod's process old by a new one, name: with surge, the new one
// starts beside the old before the old gets its SIGTERM, as a DaemonSet's maxSurge rollout
// does; else the old one gets its SIGTERM and exits first (maxUnavailable). CSINode is
// watched throughout and for watchWindow after the last step.
func (n *nodeSide) rollout(ctx context.Context, strategy, steps string, old *replica, name string, surge bool) (nodeRollout, error) {
	ro := nodeRollout{strategy: strategy, steps: steps, old: old.name, new: name, exitCode: -1}
	fmt.Fprintf(n.out, "\n== node rollout, %s: %s (%s -> %s)\n", strategy, steps, old.name, name)
	watchCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	watch, err := kubelet.WatchDriver(watchCtx, n.kube, kubeletNode, driverName)
	if err != nil {
		return ro, err
	}
	began := time.Now()
	var fresh *replica
	if surge {
		if fresh, err = n.start(name); err != nil {
			return ro, err
		}
		if err := n.waitFor(ctx, name+" waits beside "+old.name, func() (bool, error) {
			v, err := n.view(fresh)
			return v.WaitsBeside, err
		}); err != nil {
			return ro, err
		}
		n.say("started %s beside %s: it found the socket served and waits beside it, connected to %s", name, old.name, filepath.Base(n.nextPath))
	}
	signalled := time.Now()
	if err := old.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return ro, fmt.Errorf("SIGTERM to %s: %w", old.name, err)
	}
	select {
	case <-old.done:
	case <-ctx.Done():
		return ro, ctx.Err()
	}
	ro.exitCode = old.code
	n.say("SIGTERM -> %s: exited %d after %v", old.name, old.code, old.exited.Sub(signalled).Round(time.Millisecond))
	if surge {
		if err := n.waitFor(ctx, name+" serves the registration socket", func() (bool, error) {
			v, err := n.view(fresh)
			return v.Serves, err
		}); err != nil {
			return ro, err
		}
		n.say("%s serves the registration socket, handed over by %s: the file never changed", name, old.name)
	} else {
		if fresh, err = n.start(name); err != nil {
			return ro, err
		}
		if err := n.waitFor(ctx, name+" serves the registration socket", func() (bool, error) {
			v, err := n.view(fresh)
			return v.Serves, err
		}); err != nil {
			return ro, err
		}
		served := time.Now()
		n.say("started %s: it found the socket %s left and nobody serving it, and replaced it in one rename", name, old.name)
		if err := n.waitFor(ctx, "the kubelet registers the driver again", func() (bool, error) {
			return n.registrationsSince(served, true) > 0 && watch.IsPresent(), nil
		}); err != nil {
			return ro, err
		}
		n.say("the kubelet took the new socket for a new plugin and registered the driver again")
	}
	select {
	case <-time.After(watchWindow):
	case <-ctx.Done():
		return ro, ctx.Err()
	}
	end := time.Now()
	ro.absences, ro.present = watch.Absences(end), watch.IsPresent()
	ro.absent = kubelet.Absent(ro.absences)
	ro.registrations = n.registrationsSince(began, false)
	n.say("watched CSINode %v more: the driver was absent %v (%d time(s)); the kubelet registered it %d time(s)",
		watchWindow, ro.absent.Round(time.Millisecond), len(ro.absences), ro.registrations)
	return ro, nil
}

// registrationsSince counts the kubelet's registrations of the driver that started since
// (its NodeGetInfo calls; done: only those that ended).
func (n *nodeSide) registrationsSince(since time.Time, done bool) int {
	c := 0
	for _, call := range n.driver.Journal() {
		if call.Method == testdriver.MethodNodeGetInfo && !call.Start.Before(since) && (!done || call.Done()) {
			c++
		}
	}
	return c
}

// nodeSummary is the node part's table.
func (d *demo) nodeSummary(r nodeReport) {
	fmt.Fprintf(d.out, "\nNode rollouts (kubelet %s, csi-sidecars %s; CSINode watched until %v after the last step)\n",
		r.node, nodeControllers, watchWindow)
	tw := tabwriter.NewWriter(d.out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "node rollout\told -> new\texit\tdriver absent from CSINode\tkubelet registrations")
	for _, ro := range r.rollouts {
		absent := fmt.Sprintf("%v", ro.absent.Round(time.Millisecond))
		if len(ro.absences) > 0 {
			absent += fmt.Sprintf(" (%d time(s))", len(ro.absences))
		}
		if !ro.present {
			absent += ", still absent"
		}
		fmt.Fprintf(tw, "%s: %s\t%s -> %s\t%d\t%s\t%d\n", ro.strategy, ro.steps, ro.old, ro.new, ro.exitCode, absent, ro.registrations)
	}
	tw.Flush()
	fmt.Fprintln(d.out, "(Only csi-sidecars' registrar runs here. `make bench` (BenchmarkRegistrationThroughRollouts, test/e2e/noderollout)")
	fmt.Fprintln(d.out, " runs these rollouts and two more with it and with a model of upstream's node-driver-registrar.)")
}
