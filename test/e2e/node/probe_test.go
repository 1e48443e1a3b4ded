package node

import (
	"context"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/kubelet"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The kubelet's liveness probe of a driver container, answered by `csi-sidecars
// livenessprobe`: while the driver answers, the kubelet's probes pass (each is a CSI Probe
// in the driver) and the container is never restarted; once the driver stops answering,
// the kubelet restarts the container. The kubelet runs its own prober (hollow-kubelet
// --probes; kubemark's default runs none), whose events the hollow kubelet drops: its
// restart count is what the kubelet makes observable.
//
// The probe names its host, 127.0.0.1, where the livenessprobe listens: a kubelet probes the
// pod's IP otherwise, and every pod of the fake runtime has the same made-up one
// (192.168.192.168), host network or not, which the kubelet keeps over the node's.
func TestKubeletRestartsTheDriverWhenTheProbeFails(t *testing.T) {
	t.Parallel()
	e2e.RequireBinaries(t, binDir)
	cp := kube.Get(t)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	k := kubelet.Start(ctx, t, cp, kubelet.Options{Args: []string{"--probes"}})
	s := e2e.NewScenario(t, cp, binDir, testdriver.Config{DriverName: "probe.node.csi.test"})
	driver, err := s.Driver.Serve(filepath.Join(s.Dir, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(driver.Stop)

	port := e2e.FreePort(t)
	logPath := filepath.Join(t.TempDir(), "livenessprobe.log")
	probe, err := controlplane.StartChild(filepath.Join(binDir, "csi-sidecars"), logPath,
		"livenessprobe", "--csi-address="+driver.Socket(), "--health-port="+port, "--probe-timeout=1s")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := probe.Stop(); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("--- last lines of the livenessprobe (%s) ---\n%s", logPath, tail(logPath, registrarLogTail))
		}
	})

	// Pod admission needs the namespace's default ServiceAccount; no controller makes it.
	pods := s.Client.CoreV1().Pods(s.Namespace)
	if _, err := s.Client.CoreV1().ServiceAccounts(s.Namespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	portNumber, _ := strconv.Atoi(port)
	pod, err := pods.Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "csi-node"},
		Spec: corev1.PodSpec{
			NodeName:                     k.NodeName(),
			AutomountServiceAccountToken: ptr.To(false),
			Containers: []corev1.Container{{
				Name:  "csi-driver",
				Image: "registry.example/vendor/csi-driver:v1",
				LivenessProbe: &corev1.Probe{
					ProbeHandler:     corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Host: "127.0.0.1", Path: "/healthz", Port: intstr.FromInt(portNumber)}},
					PeriodSeconds:    1,
					TimeoutSeconds:   1,
					FailureThreshold: 3,
				},
			}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	status := func() (*corev1.Pod, *corev1.ContainerStatus) {
		p, err := pods.Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for i := range p.Status.ContainerStatuses {
			if p.Status.ContainerStatuses[i].Name == "csi-driver" {
				return p, &p.Status.ContainerStatuses[i]
			}
		}
		return p, nil
	}
	waitFor := func(what string, cond func(*corev1.Pod, *corev1.ContainerStatus) bool) {
		t.Helper()
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
			return cond(status()), nil
		})
		if err != nil {
			p, c := status()
			t.Fatalf("waiting until %s: %v; pod status: %+v, container: %+v", what, err, p.Status, c)
		}
	}

	waitFor("the driver container runs", func(p *corev1.Pod, c *corev1.ContainerStatus) bool {
		return c != nil && c.State.Running != nil
	})
	// Each of the kubelet's probes is one CSI Probe in the driver.
	probed, cancelProbed := context.WithTimeout(ctx, 30*time.Second)
	defer cancelProbed()
	err = s.Driver.WaitFor(probed, func(calls []testdriver.Call) bool {
		return len(testdriver.CallsOf(calls, testdriver.MethodProbe)) >= 5
	})
	if err != nil {
		t.Fatalf("the kubelet's probes never reached the driver: %v", err)
	}
	if _, c := status(); c.RestartCount != 0 || c.State.Running == nil {
		t.Fatalf("restarted while the driver answered: %+v", c)
	}
	started := time.Now()
	driver.Stop()
	waitFor("the kubelet restarts the driver container", func(_ *corev1.Pod, c *corev1.ContainerStatus) bool {
		return c != nil && c.RestartCount > 0
	})
	_, c := status()
	t.Logf("restarted %v after the driver stopped answering (period 1s, failure threshold 3)", time.Since(started).Round(100*time.Millisecond))
	if c.LastTerminationState.Terminated == nil {
		t.Errorf("no last termination state after the restart: %+v", c)
	}
}
