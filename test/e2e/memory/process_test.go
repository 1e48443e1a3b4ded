package memory

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/procmem"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// sidecar is one process to measure: ours or upstream's, one sidecar or several.
type sidecar struct {
	name string // as in the table: attacher, provisioner, resizer, combined
	ours bool
	// command is the binary (a path, or a name in the harness's BinDir) and its leading
	// arguments; flags are its own flags, the resync among them.
	command []string
	flags   []string
	// leases is how many Leases it takes: one per sidecar it runs.
	leases int
}

// ourSidecars are csi-sidecars' three subcommands and the combined process, their resyncs
// set to resync (the provisioner has no resync flag: its informers resync at the core's
// default, 10 minutes, as upstream's).
func ourSidecars(resync time.Duration) []sidecar {
	r := resync.String()
	return []sidecar{
		{name: "attacher", ours: true, command: []string{"csi-sidecars", "attacher"}, flags: []string{"--resync=" + r}, leases: 1},
		{name: "provisioner", ours: true, command: []string{"csi-sidecars", "provisioner"}, leases: 1},
		{name: "resizer", ours: true, command: []string{"csi-sidecars", "resizer"}, flags: []string{"--resync-period=" + r}, leases: 1},
		{name: "combined", ours: true, command: []string{"csi-sidecars"}, flags: []string{"--controllers=attacher,provisioner,resizer",
			"--attacher-resync=" + r, "--resizer-resync-period=" + r}, leases: 3},
	}
}

// ourSnapshotterSidecars are csi-sidecars' snapshotter subcommand and the combined process
// of all four sidecars, their resyncs set to resync. They need the snapshot CRDs and a
// driver that takes snapshots (snapshotCaps).
func ourSnapshotterSidecars(resync time.Duration) (snapshotter, combined sidecar) {
	r := resync.String()
	return sidecar{name: "snapshotter", ours: true, command: []string{"csi-sidecars", "snapshotter"}, flags: []string{"--resync-period=" + r}, leases: 1},
		sidecar{name: "combined", ours: true, command: []string{"csi-sidecars"}, flags: []string{"--controllers=attacher,provisioner,resizer,snapshotter",
			"--attacher-resync=" + r, "--resizer-resync-period=" + r, "--snapshotter-resync-period=" + r}, leases: 4}
}

// upstreamSidecar is upstream's binary for sidecar name, with its resync flag (attacher
// --resync, resizer and snapshotter --resync-period; the provisioner has none).
func upstreamSidecar(name, bin string, resync time.Duration) sidecar {
	s := sidecar{name: name, command: []string{bin}, leases: 1}
	switch name {
	case "attacher":
		s.flags = []string{"--resync=" + resync.String()}
	case "resizer", "snapshotter":
		s.flags = []string{"--resync-period=" + resync.String()}
	}
	return s
}

func (sc sidecar) label() string {
	if sc.ours {
		return "csi-sidecars " + sc.name
	}
	return "upstream " + sc.name
}

// process is a running sidecar with its own driver socket, leader-election namespace and
// diagnostics port.
type process struct {
	sidecar
	id        string // unique in the scenario: the identity, the log's and the socket's name
	namespace string // of its Leases: its own, so it leads as soon as it is up
	socket    string
	http      string
	log       string
	cmd       *exec.Cmd
	done      chan struct{}
}

// start runs sc against the scenario's control plane and driver. Both ours and upstream's
// get the same shared flags: --kubeconfig (admin), --csi-address, --leader-election in a
// namespace of their own, --http-endpoint, -v=2; ours also its identity (upstream's is the
// host name).
func start(t testing.TB, s *e2e.Scenario, sc sidecar, id string, extra ...string) *process {
	t.Helper()
	ctx := context.Background()
	p := &process{sidecar: sc, id: id, namespace: s.Namespace + "-" + id, done: make(chan struct{})}
	if _, err := s.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: p.namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating namespace %s: %v", p.namespace, err)
	}
	srv, err := s.Driver.Serve(filepath.Join(s.Dir, id+".sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	p.socket = srv.Socket()
	port := e2e.FreePort(t)
	p.http = "http://127.0.0.1:" + port
	args := append(append([]string{}, sc.command[1:]...),
		"--csi-address="+srv.Endpoint(),
		"--kubeconfig="+s.CP.KubeconfigPath(),
		"--leader-election",
		"--leader-election-namespace="+p.namespace,
		"--http-endpoint=127.0.0.1:"+port,
		"-v=2",
	)
	if sc.ours {
		args = append(args, "--leader-election-identity="+id)
	}
	args = append(append(args, sc.flags...), extra...)
	bin := sc.command[0]
	if !filepath.IsAbs(bin) {
		bin = filepath.Join(s.BinDir, bin)
	}
	p.cmd = exec.Command(bin, args...)
	if sc.ours && *flagOurEnv != "" {
		p.cmd.Env = append(os.Environ(), strings.Split(*flagOurEnv, ",")...)
	}
	p.log = filepath.Join(s.Dir, id+".log")
	logFile, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stdout, p.cmd.Stderr = logFile, logFile
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", sc.label(), err)
	}
	go func() {
		_ = p.cmd.Wait()
		logFile.Close()
		close(p.done)
	}()
	t.Cleanup(func() { p.stop() })
	return p
}

func (p *process) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// stop kills the process (its Leases are in a namespace of its own, nobody waits for
// them) and waits for it.
func (p *process) stop() {
	if p.running() {
		_ = p.cmd.Process.Kill()
	}
	<-p.done
}

// logTail is the end of the process's log, for failures.
func (p *process) logTail() string {
	raw, _ := os.ReadFile(p.log)
	if len(raw) > 4000 {
		raw = raw[len(raw)-4000:]
	}
	return string(raw)
}

func (p *process) get(path string) (int, []byte) {
	resp, err := http.Get(p.http + path)
	if err != nil {
		return 0, nil
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, body
}

// waitLeading waits until the process holds all its Leases and, for ours, /readyz
// answers 200 (its caches are synced). Upstream's sidecars start their informers only
// once they lead, and have no /readyz.
func (p *process) waitLeading(s *e2e.Scenario, timeout time.Duration) error {
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		if !p.running() {
			return false, fmt.Errorf("exited: %v", p.cmd.ProcessState)
		}
		if p.held(ctx, s) < p.leases {
			return false, nil
		}
		if p.ours {
			code, _ := p.get("/readyz")
			return code == http.StatusOK, nil
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("%s did not lead and get ready: %w\n--- log tail ---\n%s", p.label(), err, p.logTail())
	}
	return nil
}

// held counts the Leases of the process's namespace with a holder.
func (p *process) held(ctx context.Context, s *e2e.Scenario) int {
	leases, err := s.Client.CoordinationV1().Leases(p.namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return 0
	}
	n := 0
	for _, l := range leases.Items {
		if e2e.Holder(&l) != "" {
			n++
		}
	}
	return n
}

// memory is a process's resident memory from /proc/<pid>/status, in bytes: peak (VmHWM),
// now (VmRSS), and of now the anonymous part (heap, stacks, runtime) and the file-backed
// part (the binary's pages).
type memory struct{ peak, now, anon, file int64 }

func (p *process) memory() memory {
	m, err := procmem.Read(p.cmd.Process.Pid)
	if err != nil {
		return memory{}
	}
	return memory{peak: m.Peak, now: m.Now, anon: m.Anon, file: m.File}
}

// workCalls counts the calls on the process's socket that change a volume or a snapshot: on
// the steady data set a sidecar has nothing to do, so there should be none.
func (p *process) workCalls(calls []testdriver.Call) int {
	n := 0
	for _, c := range calls {
		if c.Socket != p.socket {
			continue
		}
		switch c.Method {
		case testdriver.MethodCreateVolume, testdriver.MethodDeleteVolume,
			testdriver.MethodControllerPublishVolume, testdriver.MethodControllerUnpublishVolume,
			testdriver.MethodControllerExpandVolume, testdriver.MethodControllerModifyVolume,
			testdriver.MethodCreateSnapshot, testdriver.MethodDeleteSnapshot,
			testdriver.MethodCreateVolumeGroupSnapshot, testdriver.MethodDeleteVolumeGroupSnapshot:
			n++
		}
	}
	return n
}

func mib(bytes int64) float64 { return float64(bytes) / (1 << 20) }
