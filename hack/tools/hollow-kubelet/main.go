// Command hollow-kubelet runs the real kubelet code through kubemark's hollow
// node: a fake container runtime and a fake image service stand in for
// containerd, so no containers ever run. Unlike kubemark's hollow-node it lets
// the caller choose the kubelet's root directory (and so its plugin
// registration directory <root>/plugins_registry and plugins directory
// <root>/plugins), and its ports, so that several can run side by side on one
// machine. With --probes the kubelet runs its own prober, where kubemark's
// hollow node runs none. It exits 0 on SIGTERM or SIGINT.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	clientset "k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	remote "k8s.io/cri-client/pkg"
	fakeremote "k8s.io/cri-client/pkg/fake"
	"k8s.io/klog/v2"
	cadvisortest "k8s.io/kubernetes/pkg/kubelet/cadvisor/testing"
	"k8s.io/kubernetes/pkg/kubelet/cm"
	"k8s.io/kubernetes/pkg/kubemark"
)

type config struct {
	kubeconfig   string
	nodeName     string
	rootDir      string
	nodeIP       string
	port         int
	readOnlyPort int
	maxPods      int
	probes       bool
}

func main() {
	var c config
	// A flag set of its own: the kubelet's dependencies (cadvisor) register
	// dozens of flags on the global one.
	fs := flag.NewFlagSet("hollow-kubelet", flag.ExitOnError)
	fs.StringVar(&c.kubeconfig, "kubeconfig", "", "kubeconfig the kubelet talks to the API server with (required)")
	fs.StringVar(&c.nodeName, "node-name", "", "name of the Node the kubelet registers (required)")
	fs.StringVar(&c.rootDir, "root-dir", "", "kubelet root directory; plugins_registry and plugins are made under it (required)")
	fs.StringVar(&c.nodeIP, "node-ip", "127.0.0.1", "address reported in the Node's status and bound by the kubelet's servers")
	fs.IntVar(&c.port, "port", 0, "port of the kubelet's API server (0: any free port)")
	fs.IntVar(&c.readOnlyPort, "read-only-port", 0, "port of the kubelet's read-only server (0: none)")
	fs.IntVar(&c.maxPods, "max-pods", 110, "pods the node can hold")
	fs.BoolVar(&c.probes, "probes", false, "run the kubelet's own prober (liveness, readiness and startup probes of the pods' containers) in place of kubemark's, which runs none and reports every container ready; its events are dropped, as all of the hollow kubelet's are")
	klog.InitFlags(fs)
	_ = fs.Parse(os.Args[1:])
	if c.kubeconfig == "" || c.nodeName == "" || c.rootDir == "" {
		fmt.Fprintln(os.Stderr, "hollow-kubelet: --kubeconfig, --node-name and --root-dir are required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, c); err != nil {
		klog.ErrorS(err, "hollow-kubelet failed")
		klog.Flush()
		os.Exit(1)
	}
	klog.Flush()
}

func run(ctx context.Context, c config) error {
	root, err := filepath.Abs(c.rootDir)
	if err != nil {
		return fmt.Errorf("root dir: %w", err)
	}
	if err := os.MkdirAll(root, 0o750); err != nil {
		return fmt.Errorf("root dir: %w", err)
	}
	// kubemark makes its own root dir in the temp dir; point that at ours
	// and then replace it, so nothing is left outside root.
	if err := os.Setenv("TMPDIR", root); err != nil {
		return fmt.Errorf("set TMPDIR: %w", err)
	}
	flags, kc := kubemark.GetHollowKubeletConfig(&kubemark.HollowKubeletOptions{
		NodeName:            c.nodeName,
		KubeletPort:         c.port,
		KubeletReadOnlyPort: c.readOnlyPort,
		MaxPods:             c.maxPods,
	})
	if err := os.RemoveAll(flags.RootDirectory); err != nil {
		return fmt.Errorf("remove kubemark's root dir: %w", err)
	}
	flags.RootDirectory = root
	flags.NodeIP = c.nodeIP
	kc.Address = c.nodeIP
	kc.StaticPodPath = filepath.Join(root, "static-pods")
	kc.PodLogsDir = filepath.Join(root, "pod-logs")
	for _, d := range []string{kc.StaticPodPath, kc.PodLogsDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return fmt.Errorf("kubelet dir: %w", err)
		}
	}

	restConfig, err := clientcmd.BuildConfigFromFlags("", c.kubeconfig)
	if err != nil {
		return fmt.Errorf("load kubeconfig %s: %w", c.kubeconfig, err)
	}
	restConfig.UserAgent = "hollow-kubelet"
	client, err := clientset.NewForConfig(restConfig)
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	heartbeat := *restConfig
	heartbeat.Timeout = min(kc.NodeStatusUpdateFrequency.Duration, time.Duration(kc.NodeLeaseDurationSeconds)*time.Second)
	heartbeat.QPS = -1
	heartbeatClient, err := clientset.NewForConfig(&heartbeat)
	if err != nil {
		return fmt.Errorf("heartbeat client: %w", err)
	}

	// The fake runtime serves CRI on a socket in root; its image service is
	// used directly, so no host image service (containerd) is needed.
	endpoint := "unix://" + filepath.Join(root, "cri.sock")
	runtime := fakeremote.NewFakeRemoteRuntime()
	if err := runtime.Start(endpoint); err != nil {
		return fmt.Errorf("start fake runtime: %w", err)
	}
	defer runtime.Stop()
	runtimeService, err := remote.NewRemoteRuntimeServiceBuilder().
		WithEndpoint(endpoint).
		WithConnectionTimeout(15 * time.Second).
		Build(ctx)
	if err != nil {
		return fmt.Errorf("runtime service: %w", err)
	}

	hk := kubemark.NewHollowKubelet(flags, kc, client, heartbeatClient,
		&cadvisortest.Fake{NodeName: c.nodeName},
		runtime.ImageService, runtimeService, cm.NewStubContainerManager())
	if c.probes {
		// Without a ProbeManager of the caller's the kubelet makes its own, the real one.
		hk.KubeletDeps.ProbeManager = nil
	}
	go hk.Run(ctx)
	<-ctx.Done()
	klog.InfoS("hollow-kubelet stopping", "node", c.nodeName)
	return nil
}
