package deploy

import (
	"context"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/cobra"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	hosted "github.com/csi-sidecars/csi-sidecars/internal/sidecars"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

const allFour = "--controllers=attacher,provisioner,resizer,snapshotter"

// allSix is what deploy/combined's container runs: the five leading sidecars and the
// livenessprobe.
const allSix = "--controllers=attacher,provisioner,resizer,snapshotter,health-monitor,livenessprobe"

// podSpec renders deploy/<dir> and returns the pod template of its kind object (Deployment
// or DaemonSet; each has one).
func podSpec(t *testing.T, dir, kind string) corev1.PodSpec {
	t.Helper()
	for _, obj := range build(t, dir) {
		var tmpl corev1.PodTemplateSpec
		var err error
		switch k := obj.GetKind(); {
		case k != kind:
			continue
		case k == "Deployment":
			var d appsv1.Deployment
			err = runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, &d)
			tmpl = d.Spec.Template
		case k == "DaemonSet":
			var d appsv1.DaemonSet
			err = runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, &d)
			tmpl = d.Spec.Template
		}
		if err != nil {
			t.Fatalf("deploy/%s %s %s: %v", dir, kind, obj.GetName(), err)
		}
		return tmpl.Spec
	}
	t.Fatalf("deploy/%s has no %s", dir, kind)
	return corev1.PodSpec{}
}

// sidecarContainers renders deploy/<dir> and returns the containers of its Deployment that
// run the csi-sidecars image (the driver's container is not one of them).
func sidecarContainers(t *testing.T, dir string) []corev1.Container {
	t.Helper()
	var out []corev1.Container
	for _, c := range podSpec(t, dir, "Deployment").Containers {
		if strings.HasPrefix(c.Image, "csi-sidecars:") {
			out = append(out, c)
		}
	}
	return out
}

// driverContainer is the pod's container of the vendor's driver.
func driverContainer(t *testing.T, pod corev1.PodSpec) corev1.Container {
	t.Helper()
	for _, c := range pod.Containers {
		if c.Name == "csi-driver" {
			return c
		}
	}
	t.Fatal("no csi-driver container")
	return corev1.Container{}
}

// flagValue is the value args (a csi-sidecars container's) give flag, default included,
// as the command parses them.
func flagValue(t *testing.T, args []string, flag string) string {
	t.Helper()
	cmd, rest, err := newRoot().Find(lifecycle.NormalizeArgs(args))
	if err == nil {
		err = cmd.ParseFlags(rest)
	}
	if err != nil {
		t.Fatalf("args %q: %v", args, err)
	}
	f := cmd.Flags().Lookup(flag)
	if f == nil {
		t.Fatalf("args %q: no flag --%s", args, flag)
	}
	return f.Value.String()
}

// checkDriverProbe checks that the driver container's liveness probe asks /healthz on
// port, where the livenessprobe listens.
func checkDriverProbe(t *testing.T, dir string, driver corev1.Container, port string) {
	t.Helper()
	p := driver.LivenessProbe
	if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/healthz" {
		t.Fatalf("deploy/%s: the driver container has no liveness probe of /healthz: %+v", dir, p)
	}
	probed := p.HTTPGet.Port.String()
	for _, cp := range driver.Ports {
		if cp.Name != "" && cp.Name == probed {
			probed = strconv.Itoa(int(cp.ContainerPort))
		}
	}
	if probed != port {
		t.Errorf("deploy/%s: the driver's liveness probe asks port %s (%s); the livenessprobe listens on %s", dir, probed, p.HTTPGet.Port.String(), port)
	}
}

// newRoot is the csi-sidecars command as cmd/csi-sidecars builds it, to check args with.
func newRoot() *cobra.Command {
	return lifecycle.NewRootCommand("csi-sidecars", "test", hosted.All()...)
}

// apiBudget is the --kube-api-qps and --kube-api-burst that args give a csi-sidecars process.
func apiBudget(t *testing.T, args []string) (qps float64, burst int) {
	t.Helper()
	cmd, rest, err := newRoot().Find(lifecycle.NormalizeArgs(args))
	if err == nil {
		err = cmd.ParseFlags(rest)
	}
	if err == nil {
		qps, err = cmd.Flags().GetFloat64("kube-api-qps")
	}
	if err == nil {
		burst, err = cmd.Flags().GetInt("kube-api-burst")
	}
	if err != nil {
		t.Fatalf("args %q: %v", args, err)
	}
	return qps, burst
}

// deploy/combined runs the six sidecars in one container that carries every flag of the
// six containers it replaces: shared flags once, each sidecar's own flags with its name
// as prefix, the probes on its one HTTP server, and the livenessprobe on a port of its own
// that the driver's liveness probe asks, as in the example.
func TestCombinedOverlayRunsTheSixSidecarsInOneContainer(t *testing.T) {
	combined := sidecarContainers(t, "combined")
	if len(combined) != 1 {
		t.Fatalf("deploy/combined: %d csi-sidecars containers; want exactly 1", len(combined))
	}
	c := combined[0]
	if !slices.Contains(c.Args, allSix) {
		t.Fatalf("deploy/combined container %s: args %q lack %s", c.Name, c.Args, allSix)
	}
	if err := lifecycle.ValidateArgs(newRoot(), c.Args); err != nil {
		t.Errorf("deploy/combined args %q do not pass flag validation: %v", c.Args, err)
	}

	shared := newRoot().PersistentFlags()
	example := sidecarContainers(t, "example")
	if len(example) != len(leading)+1 {
		t.Fatalf("deploy/example: %d csi-sidecars containers; want %d (the leading sidecars and the livenessprobe)", len(example), len(leading)+1)
	}
	ran := map[string]bool{}
	for _, e := range example {
		if err := lifecycle.ValidateArgs(newRoot(), e.Args); err != nil {
			t.Errorf("deploy/example container %s: args %q do not pass flag validation: %v", e.Name, e.Args, err)
		}
		ran[e.Args[0]] = true
	}
	for _, want := range append(slices.Clone(leading), "livenessprobe") {
		if !ran[want] {
			t.Errorf("deploy/example runs no %s container", want)
		}
	}
	for _, e := range example {
		sidecar := e.Args[0]
		for _, arg := range lifecycle.NormalizeArgs(e.Args[1:]) {
			name, _, _ := strings.Cut(strings.TrimPrefix(arg, "--"), "=")
			want := arg
			switch {
			case name == "http-endpoint":
				// One HTTP server instead of one per container: checked with the probes below.
				continue
			case shared.Lookup(name) == nil:
				want = "--" + sidecar + "-" + strings.TrimPrefix(arg, "--")
			}
			if !slices.Contains(c.Args, want) {
				t.Errorf("the example's %s container has %s; the combined container lacks %s", e.Name, arg, want)
			}
		}
		for _, env := range e.Env {
			if !slices.ContainsFunc(c.Env, func(v corev1.EnvVar) bool { return equality.Semantic.DeepEqual(v, env) }) {
				t.Errorf("the example's %s container sets %s; the combined container does not", e.Name, env.Name)
			}
		}
	}

	// Each sidecar has its own client and budget, as in its own container: the combined
	// container sets the same limits the four containers have.
	for _, e := range example {
		q, b := apiBudget(t, e.Args)
		if cq, cb := apiBudget(t, c.Args); cq != q || cb != b {
			t.Errorf("deploy/combined: --kube-api-qps=%v --kube-api-burst=%d, the example's %s container %v and %d", cq, cb, e.Name, q, b)
		}
	}

	var port string
	for _, arg := range c.Args {
		if v, ok := strings.CutPrefix(arg, "--http-endpoint="); ok {
			_, port, _ = net.SplitHostPort(v)
		}
	}
	if port == "" {
		t.Fatalf("deploy/combined container %s: no --http-endpoint, so no probes can reach it", c.Name)
	}
	for _, p := range []struct {
		probe *corev1.Probe
		path  string
	}{{c.LivenessProbe, "/healthz/leader-election"}, {c.ReadinessProbe, "/readyz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path || p.probe.HTTPGet.Port.String() != port {
			t.Errorf("deploy/combined container %s: want a probe of %s on port %s (--http-endpoint), have %+v", c.Name, p.path, port, p.probe)
		}
	}

	// The livenessprobe: its own listener, not the diagnostics server, and the driver's
	// liveness probe on it, in both manifests.
	probePort := flagValue(t, c.Args, "livenessprobe-health-port")
	if probePort == port {
		t.Errorf("deploy/combined: the livenessprobe's port %s is --http-endpoint's", probePort)
	}
	checkDriverProbe(t, "combined", driverContainer(t, podSpec(t, "combined", "Deployment")), probePort)
	for _, e := range example {
		if e.Args[0] == "livenessprobe" {
			checkDriverProbe(t, "example", driverContainer(t, podSpec(t, "example", "Deployment")), flagValue(t, e.Args, "health-port"))
		}
	}
}

// httpGet is the status code of a GET of url, 0 if none came.
func httpGet(url string) int {
	rsp, err := http.Get(url)
	if err != nil {
		return 0
	}
	rsp.Body.Close()
	return rsp.StatusCode
}

// leaseHolder is the holder of a Lease in the manifests' namespace, "" if none (yet).
func leaseHolder(s *e2e.Scenario, lease string) string {
	l, err := s.Client.CoordinationV1().Leases(namespace).Get(context.Background(), lease, metav1.GetOptions{})
	if err != nil {
		return ""
	}
	return e2e.Holder(l)
}

// A replica of deploy/combined, with the token of the pod's ServiceAccount, leads all five
// leading sidecars and does their five jobs, and its livenessprobe answers for the driver;
// one SIGTERM hands each of its five Leases over to a single-sidecar replica run as
// deploy/example runs it, which carries on. This is a rollout between the two manifests:
// both kinds of replica compete for the same upstream-named Leases and never both lead one.
func TestCombinedProcessDoesAllFiveJobsAndHandsOverEveryLeaseWithOneSIGTERM(t *testing.T) {
	cp := kube.Get(t)
	apply(t, cp, build(t, "combined"))
	s := e2e.NewScenario(t, cp, binDir, controllerDriver())
	snaps := installSnapshotCRDs(t, s)
	ctx := context.Background()
	store := s.SetUpStorage(nil)
	leases := map[string]string{}
	for _, sidecar := range leading {
		leases[sidecar] = leaseName(sidecar, store.Driver)
	}
	methods := map[string]string{
		"provisioner": testdriver.MethodCreateVolume,
		"attacher":    testdriver.MethodControllerPublishVolume,
		"resizer":     testdriver.MethodControllerExpandVolume,
		"snapshotter": testdriver.MethodCreateSnapshot,
		healthMonitor: testdriver.MethodControllerListVolumeHealth,
	}
	// Both manifests' pods run as csi-controller. Each replica runs its container's own args
	// from the manifest; the harness's flags after them replace only the socket, the HTTP
	// address and the Lease timings, and put the Leases where the manifests' Roles are.
	// combined-a's livenessprobe listens on a free port rather than 9808, which this
	// machine may use, and its health monitor passes every second rather than every 5
	// minutes.
	asPod := []string{"--kubeconfig=" + token(t, cp, s.Client, "controller"), "--leader-election-namespace=" + namespace}
	probePort := e2e.FreePort(t)
	a := s.Start("combined-a", append([]string{"csi-sidecars"}, sidecarContainers(t, "combined")[0].Args...),
		append(slices.Clone(asPod), "--livenessprobe-health-port="+probePort, "--health-monitor-list-volumes-interval=1s")...)
	a.WaitReady(t)
	for _, lease := range leases {
		s.WaitUntil("combined-a holds Lease "+lease, func() bool { return leaseHolder(s, lease) == "combined-a" })
	}
	// The driver's liveness probe, as the kubelet asks it: a Probe of the driver each.
	probes := func() int { return len(e2e.CallsOn(s.Driver.Journal(), a, testdriver.MethodProbe)) }
	before := probes()
	s.WaitUntil("combined-a's livenessprobe answers the driver's /healthz with 200", func() bool {
		return httpGet("http://127.0.0.1:"+probePort+"/healthz") == http.StatusOK
	})
	if probes() == before {
		t.Error("combined-a's livenessprobe answered /healthz without a Probe of the driver")
	}
	// The standbys start once combined-a leads everything, so it is the one doing the work.
	// The example's livenessprobe takes no Lease: it has no standby.
	standbys := map[string]*e2e.Replica{}
	for _, c := range sidecarContainers(t, "example") {
		sidecar := c.Args[0]
		if sidecar == "livenessprobe" {
			continue
		}
		r := s.Start(sidecar+"-b", append([]string{"csi-sidecars"}, c.Args...), asPod...)
		r.WaitReady(t)
		standbys[sidecar] = r
	}

	const n = 3
	runStorageJob(ctx, t, s, store, "claim-a", "claim-b", "claim-c")
	runSnapshotJob(ctx, t, s, snaps, store)
	markUnhealthy(ctx, t, s, store, "claim-b")
	waitHealthRecorded(ctx, s, "claim-b")
	journal := s.Driver.Journal()
	for sidecar, method := range methods {
		want := n
		if sidecar == healthMonitor {
			want = 1 // a pass a second, however long the jobs took
		}
		if got := len(e2e.CallsOn(journal, a, method)); got < want {
			t.Errorf("combined-a made %d %s calls for %d volumes; the %s in it did not do its job", got, method, n, sidecar)
		}
		for _, r := range standbys {
			if got := e2e.CallsOn(journal, r, method); len(got) > 0 {
				t.Errorf("standby %s made %d %s calls while combined-a led", r.Name, len(got), method)
			}
		}
	}

	// client-go's REST client metrics, one series set per hosted sidecar: the requests of
	// each sidecar's own clients, and the waits for its --kube-api-qps budget. A standby run
	// as deploy/example runs it serves its own too.
	checkRESTClientMetrics(t, a, leading...)
	checkRESTClientMetrics(t, standbys["attacher"], "attacher")

	signalled := a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 60*time.Second); code != 0 {
		t.Errorf("combined-a exited %d after one SIGTERM; want 0 (a clean drain of all six)", code)
	}
	for sidecar, lease := range leases {
		want := standbys[sidecar].Name
		s.WaitUntil("Lease "+lease+" is held by "+want, func() bool { return leaseHolder(s, lease) == want })
		t.Logf("Lease %s held by %s %v after the SIGTERM", lease, want, time.Since(signalled).Round(time.Millisecond))
	}

	// The provisioner's standby carries on: a further claim is provisioned through its socket.
	provB := standbys["provisioner"]
	if err := store.CreateClaim(ctx, "claim-d"); err != nil {
		t.Fatal(err)
	}
	waitCount(t, s, "volumes provisioned", n+1, func() (int, error) { pvs, err := store.Provisioned(ctx); return len(pvs), err })
	if !slices.ContainsFunc(e2e.CallsOn(s.Driver.Journal(), provB, testdriver.MethodCreateVolume), func(c testdriver.Call) bool { return c.Code == "OK" }) {
		t.Errorf("claim-d was provisioned, but not by %s: no successful CreateVolume on its socket", provB.Name)
	}
	for _, o := range s.Driver.Overlaps() {
		if o.First.Method == o.Second.Method {
			t.Errorf("two %s calls on volume %s at once (sockets %s and %s)", o.First.Method, o.Volume, o.First.Socket, o.Second.Socket)
		}
	}
}

// checkRESTClientMetrics checks that r's /metrics has rest_client_requests_total and
// rest_client_rate_limiter_duration_seconds samples of each of sidecars.
func checkRESTClientMetrics(t *testing.T, r *e2e.Replica, sidecars ...string) {
	t.Helper()
	code, body := r.Get("/metrics")
	if code != 200 {
		t.Fatalf("%s /metrics: %d %s", r.Name, code, body)
	}
	for _, sidecar := range sidecars {
		for _, name := range []string{"rest_client_requests_total", "rest_client_request_duration_seconds", "rest_client_rate_limiter_duration_seconds"} {
			n, _, err := e2e.MetricTotal(body, name, map[string]string{"sidecar": sidecar})
			if err != nil {
				t.Fatalf("%s /metrics: %v", r.Name, err)
			}
			if n == 0 {
				t.Errorf("%s /metrics: no %s{sidecar=%q} samples", r.Name, name, sidecar)
			}
		}
	}
}
