package kubelet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// regCall is one call the kubelet made to a registration server.
type regCall struct {
	method string // "GetInfo" or "NotifyRegistrationStatus"
	at     time.Time
	status *registerapi.RegistrationStatus // of NotifyRegistrationStatus
}

// regServer plays node-driver-registrar's part towards the kubelet: it serves the plugin
// registration API on a socket in the kubelet's registration dir, naming a CSI driver and
// its endpoint, and records the kubelet's calls.
type regServer struct {
	registerapi.UnimplementedRegistrationServer
	driver, endpoint, socket string

	mu    sync.Mutex
	calls []regCall
	grpc  *grpc.Server
}

func serveRegistration(t *testing.T, dir, driver, endpoint string) *regServer {
	t.Helper()
	s := &regServer{driver: driver, endpoint: endpoint, socket: filepath.Join(dir, driver+"-reg.sock")}
	lis, err := net.Listen("unix", s.socket)
	if err != nil {
		t.Fatalf("registration socket: %v", err)
	}
	s.grpc = grpc.NewServer()
	registerapi.RegisterRegistrationServer(s.grpc, s)
	go func() { _ = s.grpc.Serve(lis) }()
	t.Cleanup(s.grpc.Stop)
	return s
}

func (s *regServer) record(c regCall) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c.at = time.Now()
	s.calls = append(s.calls, c)
}

func (s *regServer) Calls() []regCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls)
}

func (s *regServer) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	s.record(regCall{method: "GetInfo"})
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              s.driver,
		Endpoint:          s.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (s *regServer) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	s.record(regCall{method: "NotifyRegistrationStatus", status: st})
	return &registerapi.RegistrationStatusResponse{}, nil
}

// waitNotified waits for the n-th NotifyRegistrationStatus and returns the calls so far.
func (s *regServer) waitNotified(ctx context.Context, n int) ([]regCall, error) {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		calls := s.Calls()
		notified := 0
		for _, c := range calls {
			if c.method == "NotifyRegistrationStatus" {
				notified++
			}
		}
		if notified >= n {
			return calls, nil
		}
		select {
		case <-ctx.Done():
			return calls, fmt.Errorf("waiting for NotifyRegistrationStatus #%d: %w", n, ctx.Err())
		case <-tick.C:
		}
	}
}

// startDriver serves the test CSI driver at <PluginsDir>/<driver>/csi.sock, as a node
// plugin would.
func startDriver(t *testing.T, k *Kubelet, driver, nodeID string) (*testdriver.Backend, *testdriver.Server) {
	t.Helper()
	b, err := testdriver.New(testdriver.Config{DriverName: driver, NodeID: nodeID, Topology: true})
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(k.PluginsDir(), driver)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	srv, err := b.Serve(filepath.Join(dir, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return b, srv
}

// checkRegistration checks the kubelet's calls of one registration: GetInfo, then the
// driver's NodeGetInfo, then NotifyRegistrationStatus(true).
func checkRegistration(t *testing.T, calls []regCall, nodeGetInfo []time.Time) {
	t.Helper()
	var getInfo, notify *regCall
	for i := range calls {
		switch calls[i].method {
		case "GetInfo":
			if getInfo == nil {
				getInfo = &calls[i]
			}
		case "NotifyRegistrationStatus":
			notify = &calls[i]
		}
	}
	if getInfo == nil || notify == nil {
		t.Fatalf("registration calls = %+v, want GetInfo and NotifyRegistrationStatus", calls)
	}
	if !notify.status.GetPluginRegistered() || notify.status.GetError() != "" {
		t.Errorf("NotifyRegistrationStatus(%+v), want registered without error", notify.status)
	}
	i := slices.IndexFunc(nodeGetInfo, func(at time.Time) bool { return at.After(getInfo.at) && at.Before(notify.at) })
	if i < 0 {
		t.Errorf("NodeGetInfo at %v, want one between GetInfo (%v) and NotifyRegistrationStatus (%v)", nodeGetInfo, getInfo.at, notify.at)
	}
}

func nodeGetInfoTimes(b *testdriver.Backend) []time.Time {
	var out []time.Time
	for _, c := range b.Journal() {
		if c.Method == testdriver.MethodNodeGetInfo {
			out = append(out, c.Start)
		}
	}
	return out
}

func driverIn(n *storagev1.CSINode, driver string) *storagev1.CSINodeDriver {
	if n == nil {
		return nil
	}
	for i := range n.Spec.Drivers {
		if n.Spec.Drivers[i].Name == driver {
			return &n.Spec.Drivers[i]
		}
	}
	return nil
}

func TestRegistrationSocketRegistersTheDriverInCSINode(t *testing.T) {
	t.Parallel()
	cp := kube.Get(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	k := Start(ctx, t, cp, Options{})
	client := kubernetes.NewForConfigOrDie(cp.Config())
	const driver = "reg.test.csi.sidecars.io"
	nodeID := "id-" + k.NodeName()
	b, srv := startDriver(t, k, driver, nodeID)

	began := time.Now()
	reg := serveRegistration(t, k.RegistrationDir(), driver, srv.Socket())
	calls, err := reg.waitNotified(ctx, 1)
	if err != nil {
		t.Fatalf("%v; calls: %+v", err, calls)
	}
	checkRegistration(t, calls, nodeGetInfoTimes(b))
	csiNode := waitCSINode(ctx, t, client, k.NodeName(), func(n *storagev1.CSINode) bool { return driverIn(n, driver) != nil })
	t.Logf("registered (NotifyRegistrationStatus) %s and in CSINode %s after the socket appeared",
		calls[len(calls)-1].at.Sub(began).Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	d := driverIn(csiNode, driver)
	if d.NodeID != nodeID {
		t.Errorf("CSINode driver node id = %q, want %q", d.NodeID, nodeID)
	}
	if !slices.Equal(d.TopologyKeys, []string{testdriver.TopologyKey}) {
		t.Errorf("CSINode driver topology keys = %v, want [%s]", d.TopologyKeys, testdriver.TopologyKey)
	}
	node, err := client.CoreV1().Nodes().Get(ctx, k.NodeName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := node.Labels[testdriver.TopologyKey]; got != nodeID {
		t.Errorf("Node label %s = %q, want %q", testdriver.TopologyKey, got, nodeID)
	}

	// A registrar that goes away removes its socket: the kubelet deregisters the driver.
	removed := time.Now()
	if err := os.Remove(reg.socket); err != nil {
		t.Fatal(err)
	}
	waitCSINode(ctx, t, client, k.NodeName(), func(n *storagev1.CSINode) bool { return n != nil && driverIn(n, driver) == nil })
	t.Logf("driver gone from CSINode %s after its registration socket was removed", time.Since(removed).Round(time.Millisecond))
}

func TestRestartedKubeletRegistersTheDriverAgain(t *testing.T) {
	t.Parallel()
	cp := kube.Get(t)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	k := Start(ctx, t, cp, Options{})
	client := kubernetes.NewForConfigOrDie(cp.Config())
	const driver = "restart.test.csi.sidecars.io"
	_, srv := startDriver(t, k, driver, "id-"+k.NodeName())
	reg := serveRegistration(t, k.RegistrationDir(), driver, srv.Socket())
	if calls, err := reg.waitNotified(ctx, 1); err != nil {
		t.Fatalf("%v; calls: %+v", err, calls)
	}

	for _, how := range []struct {
		name string
		stop func() error
	}{{"SIGTERM", k.Stop}, {"SIGKILL", k.Kill}} {
		before := len(reg.Calls())
		if err := how.stop(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-k.Process().Done():
		default:
			t.Fatalf("kubelet still running after %s", how.name)
		}
		began := time.Now()
		if err := k.Restart(ctx); err != nil {
			t.Fatal(err)
		}
		// The socket stayed in the root dir: the new kubelet finds it and registers anew.
		calls, err := reg.waitNotified(ctx, countNotified(reg.Calls()[:before])+1)
		if err != nil {
			t.Fatalf("after %s and restart: %v; calls: %+v", how.name, err, calls)
		}
		if !slices.ContainsFunc(calls[before:], func(c regCall) bool { return c.method == "GetInfo" }) {
			t.Errorf("after %s and restart: no GetInfo in %+v", how.name, calls[before:])
		}
		t.Logf("after %s: restarted and registered again in %s; calls since the stop: %s", how.name, time.Since(began).Round(time.Millisecond), describe(calls[before:], began))
		if _, err := os.Stat(reg.socket); errors.Is(err, os.ErrNotExist) {
			t.Errorf("registration socket removed by the kubelet's restart")
		}
	}
	waitCSINode(ctx, t, client, k.NodeName(), func(n *storagev1.CSINode) bool { return driverIn(n, driver) != nil })
}

func countNotified(calls []regCall) int {
	n := 0
	for _, c := range calls {
		if c.method == "NotifyRegistrationStatus" {
			n++
		}
	}
	return n
}

func describe(calls []regCall, since time.Time) string {
	out := ""
	for _, c := range calls {
		out += fmt.Sprintf(" %s@%s", c.method, c.at.Sub(since).Round(time.Millisecond))
	}
	return out
}

func TestUnreachableDriverIsReportedAsNotRegistered(t *testing.T) {
	t.Parallel()
	cp := kube.Get(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	k := Start(ctx, t, cp, Options{})
	client := kubernetes.NewForConfigOrDie(cp.Config())
	const driver = "absent.test.csi.sidecars.io"
	// No driver serves this endpoint: the kubelet cannot ask NodeGetInfo.
	reg := serveRegistration(t, k.RegistrationDir(), driver, filepath.Join(k.PluginsDir(), driver, "csi.sock"))
	calls, err := reg.waitNotified(ctx, 1)
	if err != nil {
		t.Fatalf("%v; calls: %+v", err, calls)
	}
	st := calls[len(calls)-1].status
	if st.GetPluginRegistered() || st.GetError() == "" {
		t.Errorf("NotifyRegistrationStatus(%+v), want not registered with an error", st)
	}
	t.Logf("kubelet reported: %s", st.GetError())
	csiNode := waitCSINode(ctx, t, client, k.NodeName(), func(n *storagev1.CSINode) bool { return n != nil })
	if driverIn(csiNode, driver) != nil {
		t.Errorf("CSINode lists %s, whose NodeGetInfo cannot have answered", driver)
	}
}
