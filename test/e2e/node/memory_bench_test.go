package node

import (
	"context"
	"flag"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/kubelet"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/procmem"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

var (
	flagMemoryIdle   = flag.Duration("node.memory-idle", 10*time.Second, "BenchmarkNodeContainerMemory: how long the process idles after the driver is registered before its memory is read")
	flagMemoryProbes = flag.Duration("node.memory-probes", time.Minute, "BenchmarkNodeContainerMemory: how long the kubelet's probe is asked once a second before the memory is read again")
)

// BenchmarkNodeContainerMemory measures the memory of the node container, one process of
// `csi-sidecars --controllers=node-driver-registrar,livenessprobe` as deploy/node runs it,
// beside a real kubelet and the test driver: its peak (VmHWM) and current (VmRSS) resident
// memory once the kubelet has registered the driver and the process has idled, and again
// after a minute of one liveness probe (GET /healthz on its probe port) a second. Figures
// are printed, never asserted.
func BenchmarkNodeContainerMemory(b *testing.B) {
	e2e.RequireBinaries(b, binDir)
	for range b.N {
		benchNodeContainerMemory(b)
	}
}

func benchNodeContainerMemory(b *testing.B) {
	cp := kube.Get(b)
	ctx, cancel := context.WithTimeout(b.Context(), 5*time.Minute)
	defer cancel()
	k := kubelet.Start(ctx, b, cp, kubelet.Options{})
	const driver = "memory.node.csi.test"
	nodeID := "id-" + k.NodeName()
	s := e2e.NewScenario(b, cp, binDir, driverConfig(driver, nodeID))
	dir := filepath.Join(k.PluginsDir(), driver)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		b.Fatal(err)
	}
	plugin, err := s.Driver.Serve(filepath.Join(dir, "csi.sock"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(plugin.Stop)

	probePort := e2e.FreePort(b)
	logPath := filepath.Join(b.TempDir(), "node-container.log")
	child, err := controlplane.StartChild(filepath.Join(binDir, "csi-sidecars"), logPath,
		"--controllers=node-driver-registrar,livenessprobe",
		"--csi-address="+plugin.Socket(),
		"--node-driver-registrar-kubelet-registration-path="+plugin.Socket(),
		"--node-driver-registrar-plugin-registration-path="+k.RegistrationDir(),
		"--livenessprobe-health-port="+probePort,
		"--http-endpoint=127.0.0.1:"+e2e.FreePort(b),
		"--drain-timeout=20s",
	)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := child.Stop(); err != nil {
			b.Error(err)
		}
		if b.Failed() {
			b.Logf("--- last lines of the node container (%s) ---\n%s", logPath, tail(logPath, registrarLogTail))
		}
	})
	started := time.Now()
	err = wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		n, err := s.Client.StorageV1().CSINodes().Get(ctx, k.NodeName(), metav1.GetOptions{})
		return err == nil && listsDriver(driver, nodeID)(n), nil
	})
	if err != nil {
		b.Fatalf("the kubelet did not register the driver: %v", err)
	}
	registered := time.Since(started)
	time.Sleep(*flagMemoryIdle)
	idle, err := readMemory(child.Pid())
	if err != nil {
		b.Fatal(err)
	}

	url := "http://127.0.0.1:" + probePort + "/healthz"
	probes, failed := 0, 0
	tick := time.NewTicker(time.Second)
	end := time.After(*flagMemoryProbes)
loop:
	for {
		select {
		case <-end:
			break loop
		case <-tick.C:
			probes++
			if !probeOK(ctx, url) {
				failed++
			}
		}
	}
	tick.Stop()
	probed, err := readMemory(child.Pid())
	if err != nil {
		b.Fatal(err)
	}
	select {
	case <-child.Done():
		b.Fatalf("the node container exited: %v", child.Err())
	default:
	}
	driverProbes := len(s.Driver.Calls(testdriver.MethodProbe))
	fmt.Printf("node container (node-driver-registrar + livenessprobe, one process): driver registered %v after start; idle %v after: VmHWM %.1f MiB, VmRSS %.1f MiB (anonymous %.1f MiB); after %d probes, one a second (%d failed, %d Probe calls in the driver): VmHWM %.1f MiB, VmRSS %.1f MiB (anonymous %.1f MiB)\n",
		registered.Round(10*time.Millisecond), *flagMemoryIdle, mib(idle.peak), mib(idle.now), mib(idle.anon),
		probes, failed, driverProbes, mib(probed.peak), mib(probed.now), mib(probed.anon))
	b.ReportMetric(mib(idle.peak), "idle-VmHWM-MiB")
	b.ReportMetric(mib(idle.now), "idle-VmRSS-MiB")
	b.ReportMetric(mib(probed.peak), "probed-VmHWM-MiB")
	b.ReportMetric(mib(probed.now), "probed-VmRSS-MiB")
	b.ReportMetric(float64(failed), "failed-probes")
}

// probeOK asks url once, as the kubelet's HTTP probe does, and tells whether it answered
// 200.
func probeOK(ctx context.Context, url string) bool {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false
	}
	rsp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	rsp.Body.Close()
	return rsp.StatusCode == http.StatusOK
}

// memory is a process's resident memory from /proc/<pid>/status, in bytes: peak (VmHWM),
// now (VmRSS) and of now the anonymous part.
type memory struct{ peak, now, anon int64 }

func readMemory(pid int) (memory, error) {
	m, err := procmem.Read(pid)
	return memory{peak: m.Peak, now: m.Now, anon: m.Anon}, err
}

func mib(bytes int64) float64 { return float64(bytes) / (1 << 20) }
