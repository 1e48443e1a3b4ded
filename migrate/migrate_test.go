package migrate

import (
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/sidecars"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

var update = flag.Bool("update", false, "write the golden files again")

func fixtures(t *testing.T) []string {
	t.Helper()
	ins, err := filepath.Glob("testdata/*.in.yaml")
	if err != nil || len(ins) < 5 {
		t.Fatalf("fixtures: %v %v", ins, err)
	}
	return ins
}

func convert(t *testing.T, opts Options, in []byte) *Result {
	t.Helper()
	if opts.Image == "" {
		opts.Image = "csi-sidecars:test"
	}
	res, err := Convert(opts, in)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// The output of each real driver's manifests is the golden file, byte for byte, and the
// same on every run.
func TestGolden(t *testing.T) {
	for _, in := range fixtures(t) {
		base := strings.TrimSuffix(in, ".in.yaml")
		t.Run(filepath.Base(base), func(t *testing.T) {
			data, err := os.ReadFile(in)
			if err != nil {
				t.Fatal(err)
			}
			res := convert(t, Options{}, data)
			summary := strings.Join(res.Summary, "\n") + "\n"
			if again := convert(t, Options{}, data); string(again.Output) != string(res.Output) {
				t.Errorf("two runs on the same input differ")
			}
			if *update {
				if err := os.WriteFile(base+".out.yaml", res.Output, 0o644); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(base+".summary.txt", []byte(summary), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			for file, got := range map[string]string{base + ".out.yaml": string(res.Output), base + ".summary.txt": summary} {
				want, err := os.ReadFile(file)
				if err != nil {
					t.Fatalf("%v (run with -update)", err)
				}
				if got != string(want) {
					t.Errorf("%s differs from what migrate writes now (run with -update and review the diff)", file)
				}
			}
		})
	}
}

// workloadContainers are the containers of every pod template in a stream, by workload.
func workloadContainers(t *testing.T, data []byte) map[string][]corev1.Container {
	t.Helper()
	out := map[string][]corev1.Container{}
	for _, d := range splitDocuments(data) {
		if err := d.parse(); err != nil {
			t.Fatal(err)
		}
		if !isWorkload(d) {
			continue
		}
		var cs []corev1.Container
		if err := decode(path(d.root(), "spec", "template", "spec", "containers"), &cs); err != nil {
			t.Fatal(err)
		}
		out[d.String()] = cs
	}
	return out
}

// Every csi-sidecars container migrate writes passes the binary's own flag validation,
// with $(VAR) expanded from its env as the kubelet does; upstream's images are gone.
func TestMigratedArgsPassValidation(t *testing.T) {
	for _, in := range fixtures(t) {
		data, err := os.ReadFile(in)
		if err != nil {
			t.Fatal(err)
		}
		res := convert(t, Options{}, data)
		for w, cs := range workloadContainers(t, res.Output) {
			for _, c := range cs {
				if s := sidecarOf(c.Image, c.Command); s != "" {
					t.Errorf("%s %s: container %s still runs upstream's %s", in, w, c.Name, c.Image)
				}
				if c.Image != "csi-sidecars:test" {
					continue
				}
				env := map[string]string{"NODE_NAME": "node-1", "POD_NAME": "pod-1", "POD_NAMESPACE": "ns"}
				for _, e := range c.Env {
					if e.ValueFrom == nil {
						env[e.Name] = e.Value
					} else {
						env[e.Name] = "from-field"
					}
				}
				var args []string
				for _, a := range c.Args {
					for k, v := range env {
						a = strings.ReplaceAll(a, "$("+k+")", v)
					}
					args = append(args, a)
				}
				for k, v := range env {
					t.Setenv(k, v)
				}
				if err := lifecycle.ValidateArgs(lifecycle.NewRootCommand("csi-sidecars", "test", sidecars.All()...), args); err != nil {
					t.Errorf("%s %s: container %s args %q: %v", in, w, c.Name, args, err)
				}
			}
		}
	}
}

// migrate then migrate --reverse gives back every workload's containers: names, images,
// args, env, mounts, ports, probes, resources, security context, in their order; and the
// Services and monitors it repointed.
func TestRoundTrip(t *testing.T) {
	for _, in := range fixtures(t) {
		t.Run(filepath.Base(in), func(t *testing.T) {
			data, err := os.ReadFile(in)
			if err != nil {
				t.Fatal(err)
			}
			there := convert(t, Options{}, data)
			back := convert(t, Options{Reverse: true}, there.Output)
			want, got := workloadContainers(t, data), workloadContainers(t, back.Output)
			for w, cs := range want {
				if len(got[w]) != len(cs) {
					t.Errorf("%s: %d containers after the round trip, want %d", w, len(got[w]), len(cs))
					continue
				}
				for i := range cs {
					if !reflect.DeepEqual(got[w][i], cs[i]) {
						t.Errorf("%s: container %d after the round trip:\n%s %s %q\nwant\n%s %s %q\n(or another field differs)", w, i, got[w][i].Name, got[w][i].Image, got[w][i].Args, cs[i].Name, cs[i].Image, cs[i].Args)
					}
				}
			}
			for _, d := range splitDocuments(back.Output) {
				if strings.Contains(d.raw, annotation) {
					t.Errorf("the annotation %s is left after --reverse", annotation)
				}
			}
		})
	}
	// The repointed Service and ServiceMonitor get their ports back.
	data, _ := os.ReadFile("testdata/metrics.in.yaml")
	back := convert(t, Options{Reverse: true}, convert(t, Options{}, data).Output)
	for _, want := range []string{"{name: provisioner, port: 8081}", "targetPort: 8081"} {
		if !strings.Contains(string(back.Output), want) {
			t.Errorf("after the round trip the output lacks %q", want)
		}
	}
}

// --reverse puts the images the user names.
func TestReverseUsesTheNamedImages(t *testing.T) {
	data, _ := os.ReadFile("testdata/hostpath.in.yaml")
	img := "registry.k8s.io/sig-storage/csi-attacher:v4.13.0"
	back := convert(t, Options{Reverse: true, UpstreamImages: map[string]string{"attacher": img}}, convert(t, Options{}, data).Output)
	for _, c := range workloadContainers(t, back.Output)["StatefulSet default/csi-hostpathplugin"] {
		if c.Name == "csi-attacher" && c.Image != img {
			t.Errorf("csi-attacher's image after --reverse: %s, want %s", c.Image, img)
		}
	}
}

func TestMetricsPortsAndRBAC(t *testing.T) {
	data, _ := os.ReadFile("testdata/metrics.in.yaml")
	res := convert(t, Options{}, data)
	out := string(res.Output)
	if !strings.Contains(out, "{name: provisioner, port: 8081, targetPort: attacher-http}") {
		t.Errorf("the Service's provisioner port does not target the one diagnostics endpoint:\n%s", out)
	}
	summary := strings.Join(res.Summary, "\n")
	for _, want := range []string{"lacks patch volumeattachments.storage.k8s.io (attacher)", "get,create,update leases.coordination.k8s.io", "no cpu limit", "port 8081 (provisioner-http) is gone"} {
		if !strings.Contains(summary, want) {
			t.Errorf("summary lacks %q:\n%s", want, summary)
		}
	}
	c := workloadContainers(t, res.Output)["Deployment storage/csi-controller"][1]
	if got := c.Resources.Requests.Memory().String(); got != "128Mi" {
		t.Errorf("memory request %s, want the sum 128Mi", got)
	}
	if got := c.Resources.Limits.Memory().String(); got != "384Mi" {
		t.Errorf("memory limit %s, want the sum 384Mi", got)
	}
	if sc := c.SecurityContext; sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || !reflect.DeepEqual(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("security context %+v: want read-only root, drop ALL (what both dropped)", sc)
	}
}

func TestRefusesWhatItCannotRead(t *testing.T) {
	for in, want := range map[string]string{
		"a: [":       "document 1",
		"- a\n- b\n": "not a Kubernetes object",
		"apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  template:\n    spec:\n      containers:\n        - {name: att, image: registry.k8s.io/sig-storage/csi-attacher:v4.13.0, args: [--csi-address=/csi/csi.sock, --bogus=1]}\n": "container att (attacher): unknown flag: --bogus=1",
	} {
		_, err := Convert(Options{Image: "x"}, []byte(in))
		if !IsInputError(err) || !strings.Contains(err.Error(), want) {
			t.Errorf("input %q: error %v; want an InputError with %q", in, err, want)
		}
	}
}

// The command exits 2 on a file it cannot read and on an unknown flag.
func TestCommandExitCodes(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  template:\n    spec:\n      containers:\n        - {name: reg, image: csi-node-driver-registrar:v2.17.0, args: [--nope]}\n"), 0o644)
	for _, args := range [][]string{{"migrate", filepath.Join(dir, "missing.yaml")}, {"migrate", bad}} {
		root := lifecycle.NewRootCommand("csi-sidecars", "test", sidecars.All()...)
		root.AddCommand(NewCommand("test"))
		var stderr strings.Builder
		if code := lifecycle.Execute(t.Context(), root, args, &stderr); code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, code, stderr.String())
		}
	}
}
