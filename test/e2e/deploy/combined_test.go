package deploy

import (
	"context"
	"net"
	"slices"
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

// sidecarContainers renders deploy/<dir> and returns the containers of its Deployment that
// run the csi-sidecars image (the driver's container is not one of them).
func sidecarContainers(t *testing.T, dir string) []corev1.Container {
	t.Helper()
	var out []corev1.Container
	for _, obj := range build(t, dir) {
		if obj.GetKind() != "Deployment" {
			continue
		}
		var d appsv1.Deployment
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, &d); err != nil {
			t.Fatalf("deploy/%s Deployment %s: %v", dir, obj.GetName(), err)
		}
		for _, c := range d.Spec.Template.Spec.Containers {
			if strings.HasPrefix(c.Image, "csi-sidecars:") {
				out = append(out, c)
			}
		}
	}
	return out
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

// deploy/combined runs the four sidecars in one container that carries every flag of the
// four containers it replaces: shared flags once, each sidecar's own flags with its name
// as prefix, and the probes on its one HTTP server.
func TestCombinedOverlayRunsTheFourSidecarsInOneContainer(t *testing.T) {
	combined := sidecarContainers(t, "combined")
	if len(combined) != 1 {
		t.Fatalf("deploy/combined: %d csi-sidecars containers; want exactly 1", len(combined))
	}
	c := combined[0]
	if !slices.Contains(c.Args, allFour) {
		t.Fatalf("deploy/combined container %s: args %q lack %s", c.Name, c.Args, allFour)
	}
	if err := lifecycle.ValidateArgs(newRoot(), c.Args); err != nil {
		t.Errorf("deploy/combined args %q do not pass flag validation: %v", c.Args, err)
	}

	shared := newRoot().PersistentFlags()
	example := sidecarContainers(t, "example")
	if len(example) != len(sidecars) {
		t.Fatalf("deploy/example: %d csi-sidecars containers; want %d", len(example), len(sidecars))
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
}

// leaseHolder is the holder of a Lease in the manifests' namespace, "" if none (yet).
func leaseHolder(s *e2e.Scenario, lease string) string {
	l, err := s.Client.CoordinationV1().Leases(namespace).Get(context.Background(), lease, metav1.GetOptions{})
	if err != nil {
		return ""
	}
	return e2e.Holder(l)
}

// A replica of deploy/combined, with the token of the pod's ServiceAccount, leads all four
// sidecars and does their four jobs; one SIGTERM hands each of its four Leases over to a
// single-sidecar replica run as deploy/example runs it, which carries on. This is a rollout
// between the two manifests: both kinds of replica compete for the same upstream-named
// Leases and never both lead one.
func TestCombinedProcessDoesAllFourJobsAndHandsOverEveryLeaseWithOneSIGTERM(t *testing.T) {
	cp := kube.Get(t)
	apply(t, cp, build(t, "combined"))
	s := e2e.NewScenario(t, cp, binDir, withSnapshots())
	snaps := installSnapshotCRDs(t, s)
	ctx := context.Background()
	store := s.SetUpStorage(nil)
	leases := map[string]string{}
	for _, sidecar := range sidecars {
		leases[sidecar] = leaseName(sidecar, store.Driver)
	}
	methods := map[string]string{
		"provisioner": testdriver.MethodCreateVolume,
		"attacher":    testdriver.MethodControllerPublishVolume,
		"resizer":     testdriver.MethodControllerExpandVolume,
		"snapshotter": testdriver.MethodCreateSnapshot,
	}
	// Both manifests' pods run as csi-controller. Each replica runs its container's own args
	// from the manifest; the harness's flags after them replace only the socket, the HTTP
	// address and the Lease timings, and put the Leases where the manifests' Roles are.
	asPod := []string{"--kubeconfig=" + token(t, cp, s.Client, "controller"), "--leader-election-namespace=" + namespace}
	a := s.Start("combined-a", append([]string{"csi-sidecars"}, sidecarContainers(t, "combined")[0].Args...), asPod...)
	a.WaitReady(t)
	for _, lease := range leases {
		s.WaitUntil("combined-a holds Lease "+lease, func() bool { return leaseHolder(s, lease) == "combined-a" })
	}
	// The standbys start once combined-a leads everything, so it is the one doing the work.
	standbys := map[string]*e2e.Replica{}
	for _, c := range sidecarContainers(t, "example") {
		sidecar := c.Args[0]
		r := s.Start(sidecar+"-b", append([]string{"csi-sidecars"}, c.Args...), asPod...)
		r.WaitReady(t)
		standbys[sidecar] = r
	}

	const n = 3
	runStorageJob(ctx, t, s, store, "claim-a", "claim-b", "claim-c")
	runSnapshotJob(ctx, t, s, snaps, store)
	journal := s.Driver.Journal()
	for sidecar, method := range methods {
		if got := len(e2e.CallsOn(journal, a, method)); got < n {
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
	checkRESTClientMetrics(t, a, sidecars...)
	checkRESTClientMetrics(t, standbys["attacher"], "attacher")

	signalled := a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 60*time.Second); code != 0 {
		t.Errorf("combined-a exited %d after one SIGTERM; want 0 (a clean drain of all four)", code)
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
