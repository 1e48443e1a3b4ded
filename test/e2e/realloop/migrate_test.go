package realloop

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstream"
	"github.com/csi-sidecars/csi-sidecars/migrate"
)

// controllerDeployment is the controller Deployment the migration starts from.
const controllerDeployment = "csi-controller"

// upstreamManifest is a controller Deployment of upstream's provisioner, attacher and
// resizer (upstream.Releases' tags), each with the flags the rolling upgrade from upstream's
// images gives it: leader election at upstream's default timings, its diagnostics
// endpoint and -v=2.
func upstreamManifest() []byte {
	var b strings.Builder
	fmt.Fprintf(&b, `apiVersion: apps/v1
kind: Deployment
metadata:
  name: %s
spec:
  replicas: %d
  selector:
    matchLabels: {app: %[1]s}
  template:
    metadata:
      labels: {app: %[1]s}
    spec:
      serviceAccountName: %[1]s
      containers:
`, controllerDeployment, rollingReplicas)
	for i, sc := range sidecars() {
		r := release(sc.Name())
		fmt.Fprintf(&b, `      - name: %s
        image: registry.k8s.io/sig-storage/%s:%s
        args:
        - --csi-address=$(ADDRESS)
        - --leader-election
        - --leader-election-lease-duration=15s
        - --leader-election-renew-deadline=10s
        - --leader-election-retry-period=5s
        - --http-endpoint=:%d
        - --v=2
        env:
        - {name: ADDRESS, value: /csi/csi.sock}
        volumeMounts:
        - {name: socket-dir, mountPath: /csi}
`, r.Cmd, r.Cmd, r.Tag, 8080+i)
	}
	b.WriteString(`      volumes:
      - {name: socket-dir, emptyDir: {}}
`)
	return []byte(b.String())
}

// release is upstream's release of sidecar.
func release(sidecar string) upstream.Release {
	for _, r := range upstream.Releases() {
		if r.Sidecar == sidecar {
			return r
		}
	}
	panic("no upstream release of " + sidecar)
}

// migration is what a migration's replicas run: the containers of upstream's manifest, of
// what `migrate` made of it (one csi-sidecars container) and of what `migrate --reverse`
// made of that, each with its own args and env. A replica substitutes only what a pod has
// in a cluster and a process here does not: the socket, the diagnostics port, the
// kubeconfig and the Leases' namespace; its host name is its pod's name, which both
// upstream's and ours take their leader-election identity from.
type migration struct {
	binaries map[string]string // upstream's, by sidecar
	// upstream and reversed are the upstream manifest's containers and migrate --reverse's,
	// by sidecar; merged is migrate's.
	upstream, reversed map[string]corev1.Container
	merged             corev1.Container
}

// newMigration runs migrate on upstreamManifest and migrate --reverse on its output, and
// checks that the one gives one csi-sidecars container for the three and the other the
// three containers with their args again.
func newMigration(t testing.TB, up implementation) *migration {
	t.Helper()
	in := upstreamManifest()
	m := &migration{binaries: up.binaries, upstream: upstreamContainers(t, in, "the upstream manifest")}
	out, err := migrate.Convert(migrate.Options{Image: "csi-sidecars:test"}, in)
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}
	pod, err := e2e.PodSpec(out.Output, "Deployment", controllerDeployment)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(pod.Spec.Containers); n != 1 || !slices.Contains(pod.Spec.Containers[0].Args, "--controllers=provisioner,attacher,resizer") {
		t.Fatalf("migrate made %d containers of upstream's three, want one csi-sidecars container with the three:\n%s\nsummary:\n%s",
			n, out.Output, strings.Join(out.Summary, "\n"))
	}
	m.merged = pod.Spec.Containers[0]
	back, err := migrate.Convert(migrate.Options{Reverse: true}, out.Output)
	if err != nil {
		t.Fatalf("migrate --reverse: %v", err)
	}
	m.reversed = upstreamContainers(t, back.Output, "migrate --reverse's output")
	for sc, c := range m.upstream {
		if r := m.reversed[sc]; !slices.Equal(r.Args, c.Args) || r.Image != c.Image {
			t.Fatalf("migrate --reverse gave %s image %s args %q; the input had %s %q", sc, r.Image, r.Args, c.Image, c.Args)
		}
	}
	return m
}

// upstreamContainers are the Deployment's containers of upstream's three sidecars, by
// sidecar, told by their images.
func upstreamContainers(t testing.TB, manifest []byte, what string) map[string]corev1.Container {
	t.Helper()
	pod, err := e2e.PodSpec(manifest, "Deployment", controllerDeployment)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	out := map[string]corev1.Container{}
	for _, c := range pod.Spec.Containers {
		for _, sc := range sidecars() {
			if r := release(sc.Name()); strings.Contains(c.Image, "/"+r.Cmd+":") {
				out[sc.Name()] = c
			}
		}
	}
	if len(out) != len(sidecars()) {
		t.Fatalf("%s: containers %v; want upstream's %d sidecars", what, pod.Spec.Containers, len(sidecars()))
	}
	return out
}

// start starts replica p's processes: ours from migrate's container, upstream's from the
// input's, or from migrate --reverse's for a rollback.
func (m *migration) start(w *world, p *podReplica, rollback bool) {
	w.T.Helper()
	if p.ours {
		// requestLogFlags feed the timeline of a long stall, as for every replica of ours.
		proc := w.StartCommand(p.id, m.command(w, m.merged, "csi-sidecars", p.id, requestLogFlags...))
		p.procs = append(p.procs, proc)
		for _, sc := range sidecars() {
			p.bySidecar[sc.Name()] = proc
		}
		return
	}
	containers := m.upstream
	if rollback {
		containers = m.reversed
	}
	for _, sc := range sidecars() {
		proc := w.StartCommand(p.id+"-"+sc.Name(), m.command(w, containers[sc.Name()], m.binaries[sc.Name()], p.id))
		p.procs = append(p.procs, proc)
		p.bySidecar[sc.Name()] = proc
	}
}

// command runs container c's args and env with binary, in pod id, substituting the socket
// (ADDRESS) and the diagnostics endpoint, and adding what a pod has in-cluster: the
// kubeconfig and the namespace of the Leases.
func (m *migration) command(w *world, c corev1.Container, binary, id string, extra ...string) func(e2e.Endpoints) e2e.Command {
	return func(ep e2e.Endpoints) e2e.Command {
		env, err := e2e.ContainerEnv(c, nil)
		if err != nil {
			w.T.Fatal(err)
		}
		if _, ok := env["ADDRESS"]; !ok {
			w.T.Fatalf("container %s has no ADDRESS: env %v", c.Name, c.Env)
		}
		env["ADDRESS"] = ep.Socket
		args, err := e2e.SetFlags(e2e.ExpandArgs(c.Args, env), map[string]string{"http-endpoint": ep.HTTP})
		if err != nil {
			w.T.Fatalf("container %s: %v", c.Name, err)
		}
		args = append(args, "--kubeconfig="+ep.Kubeconfig, "--leader-election-namespace="+w.Namespace)
		return e2e.Command{Binary: binary, Args: append(args, extra...), Env: e2e.EnvList(c, env), Host: id}
	}
}

// A live migration with `csi-sidecars migrate` and its rollback, as two rolling updates
// while Pods with claims keep coming: two replicas of upstream's provisioner, attacher and
// resizer (built from the Go module proxy; skipped until they are) run a
// controller Deployment's containers; two steps replace them with replicas running the one
// container migrate made of the three, and every Lease passes to ours; two more steps
// replace those with upstream's replicas again, running the containers migrate --reverse
// gave back, which take every Lease back. Every replica of ours exits 0 having released
// its Leases, every claim goes through its whole life, nothing is left and no two calls of
// one sidecar on a volume overlapped. (A benchmark run builds upstream's binaries; tests
// use them once cached. Its name is one of upstreamTests.)
func TestLiveMigrationWithMigrateAndRollbackWithReverse(t *testing.T) {
	from := upstreamFrom(t)
	r := rollingUpgrade(t, rollout{name: "migrate and roll back", from: from, migration: newMigration(t, from)}, testLoad())
	r.log(t)
	migrated, rolledBack := r.halves()
	t.Logf("FIGURE migrate and roll back: longest stall of the migration %v, of the rollback %v",
		migrated.Round(time.Millisecond), rolledBack.Round(time.Millisecond))
}

// halves are the longest stalls of a migration's steps and of its rollback's.
func (r *rolling) halves() (migrated, rolledBack time.Duration) {
	for i, st := range r.steps {
		if r.ro.rollsBack(i) {
			rolledBack = max(rolledBack, st.stall.length())
		} else {
			migrated = max(migrated, st.stall.length())
		}
	}
	return migrated, rolledBack
}
