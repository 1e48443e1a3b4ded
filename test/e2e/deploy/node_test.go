package deploy

import (
	"path"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// kubeletRegistry is where the kubelet looks for plugin registration sockets.
const kubeletRegistry = "/var/lib/kubelet/plugins_registry"

// nodeDaemonSet renders deploy/node and returns its DaemonSet.
func nodeDaemonSet(t *testing.T) appsv1.DaemonSet {
	t.Helper()
	for _, obj := range build(t, "node") {
		if obj.GetKind() != "DaemonSet" {
			continue
		}
		var ds appsv1.DaemonSet
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, &ds); err != nil {
			t.Fatalf("deploy/node DaemonSet %s: %v", obj.GetName(), err)
		}
		return ds
	}
	t.Fatal("deploy/node has no DaemonSet")
	return appsv1.DaemonSet{}
}

// hostPathAt is the host path of the volume c mounts at dir, "" if none is mounted there or
// it is no hostPath volume.
func hostPathAt(pod corev1.PodSpec, c corev1.Container, dir string) string {
	for _, m := range c.VolumeMounts {
		if path.Clean(m.MountPath) != path.Clean(dir) {
			continue
		}
		for _, v := range pod.Volumes {
			if v.Name == m.Name && v.HostPath != nil {
				return path.Clean(v.HostPath.Path)
			}
		}
	}
	return ""
}

// deploy/node's csi-sidecars container passes flag validation, and the paths its registrar
// announces and uses are where the kubelet and the driver have them: the socket it gives
// the kubelet (--node-driver-registrar-kubelet-registration-path) is, on the host, the one
// the driver serves and the registrar dials (--csi-address), and its registration folder
// (--node-driver-registrar-plugin-registration-path, default /registration) is the
// kubelet's. Its rolling update surges, which this registrar keeps the driver registered
// through (README, "Keeping the driver registered").
func TestNodeDaemonSetRegistersTheDriverWhereTheKubeletLooks(t *testing.T) {
	ds := nodeDaemonSet(t)
	pod := ds.Spec.Template.Spec
	var c *corev1.Container
	for i := range pod.Containers {
		if strings.HasPrefix(pod.Containers[i].Image, "csi-sidecars:") {
			if c != nil {
				t.Fatalf("deploy/node: csi-sidecars containers %s and %s; want one", c.Name, pod.Containers[i].Name)
			}
			c = &pod.Containers[i]
		}
	}
	if c == nil {
		t.Fatal("deploy/node: no csi-sidecars container")
	}
	if err := lifecycle.ValidateArgs(newRoot(), c.Args); err != nil {
		t.Errorf("deploy/node container %s: args %q do not pass flag validation: %v", c.Name, c.Args, err)
	}
	controllers := flagValue(t, c.Args, "controllers")
	for _, want := range []string{"node-driver-registrar", "livenessprobe"} {
		if !strings.Contains(controllers, want) {
			t.Errorf("deploy/node: --controllers=%s lacks %s", controllers, want)
		}
	}

	// The driver's socket: served by the driver, dialled by the registrar, announced to
	// the kubelet at its host path.
	csiAddress := strings.TrimPrefix(flagValue(t, c.Args, "csi-address"), "unix://")
	announced := flagValue(t, c.Args, "node-driver-registrar-kubelet-registration-path")
	if announced == "" || !path.IsAbs(announced) {
		t.Fatalf("deploy/node: --node-driver-registrar-kubelet-registration-path=%q; want the socket's absolute host path", announced)
	}
	if got := hostPathAt(pod, *c, path.Dir(csiAddress)); got != path.Dir(announced) || path.Base(csiAddress) != path.Base(announced) {
		t.Errorf("deploy/node: the registrar dials %s, which is %s/%s on the host; it announces %s to the kubelet",
			csiAddress, got, path.Base(csiAddress), announced)
	}
	driver := driverContainer(t, pod)
	var endpoint string
	for _, arg := range driver.Args {
		if v, ok := strings.CutPrefix(arg, "--endpoint="); ok {
			endpoint = strings.TrimPrefix(v, "unix://")
		}
	}
	if got := hostPathAt(pod, driver, path.Dir(endpoint)); endpoint == "" || path.Join(got, path.Base(endpoint)) != announced {
		t.Errorf("deploy/node: the driver serves --endpoint %q, %s on the host; the registrar announces %s", endpoint, path.Join(got, path.Base(endpoint)), announced)
	}

	// The registration folder: the kubelet's, mounted where the registrar puts its socket.
	registration := flagValue(t, c.Args, "node-driver-registrar-plugin-registration-path")
	if got := hostPathAt(pod, *c, registration); got != kubeletRegistry {
		t.Errorf("deploy/node: the registrar's registration folder %s is %q on the host; want the kubelet's %s", registration, got, kubeletRegistry)
	}

	// The livenessprobe answers the driver's liveness probe, apart from the diagnostics.
	probePort := flagValue(t, c.Args, "livenessprobe-health-port")
	if strings.HasSuffix(flagValue(t, c.Args, "http-endpoint"), ":"+probePort) {
		t.Errorf("deploy/node: the livenessprobe's port %s is --http-endpoint's", probePort)
	}
	checkDriverProbe(t, "node", driver, probePort)

	u := ds.Spec.UpdateStrategy
	if u.Type != appsv1.RollingUpdateDaemonSetStrategyType || u.RollingUpdate == nil ||
		u.RollingUpdate.MaxSurge == nil || u.RollingUpdate.MaxSurge.String() != "1" ||
		u.RollingUpdate.MaxUnavailable == nil || u.RollingUpdate.MaxUnavailable.String() != "0" {
		t.Errorf("deploy/node: update strategy %+v; want a rolling update with maxSurge 1 and maxUnavailable 0", u)
	}
}
