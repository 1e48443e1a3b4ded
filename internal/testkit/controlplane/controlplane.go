// Package controlplane starts a real kube-apiserver backed by a real etcd on
// the loopback interface, for integration tests.
//
// It owns the lifetime of those two child processes and of one temporary
// directory holding their state (etcd data, serving certificates, the token
// file, the ServiceAccount signing key and an admin kubeconfig). It does not
// run kube-controller-manager, a scheduler or a kubelet: objects are stored
// and validated, admission and RBAC are enforced, but nothing reconciles them
// (no Pods are ever scheduled, namespaces get no "default" ServiceAccount).
// Package cluster runs kube-controller-manager and kube-scheduler next to it,
// as children started the same way (Child).
//
// The binaries are built once per machine by hack/control-plane.sh (make
// testenv); see Assets. Most test packages should use Shared from TestMain so
// that one control plane serves the whole package.
package controlplane

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// KubernetesVersion is the kube-apiserver version hack/control-plane.sh builds.
// It is part of the default assets folder name so that bumping it never reuses
// stale binaries.
const KubernetesVersion = "v1.37.2"

const (
	// AssetsEnv overrides the folder holding the etcd and kube-apiserver binaries.
	AssetsEnv = "CSI_SIDECARS_ASSETS"

	defaultReadyTimeout = 60 * time.Second
	// apiserverStopGrace bounds StopAPIServer's wait for a SIGTERMed
	// kube-apiserver; it normally exits within a couple of seconds.
	apiserverStopGrace = 30 * time.Second
	// adminUser is a member of system:masters, which RBAC always allows.
	adminUser = "admin"
	// logTailLines is how much of a log a start-up error quotes.
	logTailLines = 25
)

// Options tunes Start. The zero value is ready to use.
type Options struct {
	// LogDir receives etcd.log and apiserver.log (appended to, so one folder
	// can collect several runs). Default: a folder inside the control plane's
	// temporary directory, removed by Stop (but kept when Start fails, so the
	// error can point at it).
	LogDir string
	// AssetsDir holds the etcd and kube-apiserver binaries. Default: Assets().
	AssetsDir string
	// APIServerArgs are appended to the kube-apiserver command line; a repeated
	// flag overrides the default, e.g. "--feature-gates=Foo=true".
	APIServerArgs []string
	// ReadyTimeout bounds the wait for /readyz and the system namespaces.
	// Default: 60s.
	ReadyTimeout time.Duration
}

// ControlPlane is a running etcd + kube-apiserver pair. Its methods are safe
// for concurrent use.
type ControlPlane struct {
	// Set by Start and read-only afterwards.
	dir          string // temporary directory owned by this control plane
	logDir       string
	url          string
	token        string // admin bearer token
	caData       []byte // PEM of the apiserver's self-signed serving chain
	kubeconfig   string
	readyTimeout time.Duration
	// etcd's command line, which StartEtcd reuses: same ports and data.
	etcdURL  string
	etcdPath string
	etcdArgs []string
	// The first kube-apiserver's command line, which StartAPIServer reuses
	// as is: same port and etcd, and the same --cert-dir, so the serving
	// certificate in caData stays valid.
	apiserverPath string
	apiserverArgs []string

	mu sync.Mutex
	// apiserver is the latest kube-apiserver started, possibly exited.
	apiserver *process
	// etcd is the latest etcd started, possibly exited.
	etcd *process
	// stopped is set once Stop begins; no kube-apiserver may start after it,
	// so the one Stop kills is the last one.
	stopped bool

	stopOnce sync.Once
	stopErr  error
}

// Assets returns the folder holding both the etcd and kube-apiserver binaries:
// $CSI_SIDECARS_ASSETS if set, else the cache folder hack/control-plane.sh
// builds into. The error names the missing binary and how to build it.
func Assets() (string, error) {
	dir := os.Getenv(AssetsEnv)
	if dir == "" {
		// Mirror hack/control-plane.sh rather than os.UserCacheDir, which differs
		// from the script on macOS.
		cache := os.Getenv("XDG_CACHE_HOME")
		if cache == "" {
			home, err := os.UserHomeDir()
			if err != nil {
				return "", fmt.Errorf("control plane assets: locate home directory (or set %s): %w", AssetsEnv, err)
			}
			cache = filepath.Join(home, ".cache")
		}
		dir = filepath.Join(cache, "csi-sidecars", "k8s-"+KubernetesVersion)
	}
	for _, bin := range []string{"etcd", "kube-apiserver"} {
		if err := checkExecutable(filepath.Join(dir, bin)); err != nil {
			return "", fmt.Errorf("control plane assets: %w; run `make testenv` (hack/control-plane.sh) to build etcd and kube-apiserver %s into %s, or set %s to a folder holding both",
				err, KubernetesVersion, dir, AssetsEnv)
		}
	}
	return dir, nil
}

func checkExecutable(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%s is missing", path)
		}
		return fmt.Errorf("stat %s: %w", path, err)
	}
	if fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%s is not an executable file", path)
	}
	return nil
}

// Start launches etcd and kube-apiserver on free loopback ports and returns
// once /readyz answers and the "default" and "kube-system" namespaces exist.
// ctx bounds the whole start-up; cancelling it later has no effect, call Stop.
func Start(ctx context.Context, opts Options) (*ControlPlane, error) {
	assets := opts.AssetsDir
	if assets == "" {
		var err error
		if assets, err = Assets(); err != nil {
			return nil, err
		}
	}
	if opts.ReadyTimeout <= 0 {
		opts.ReadyTimeout = defaultReadyTimeout
	}

	// Free ports are picked by binding and releasing them, so another process
	// may grab one before etcd or the apiserver binds it. That is rare but
	// would make tests flaky, hence a couple of retries for that case only.
	const attempts = 3
	var err error
	for i := 0; i < attempts; i++ {
		var cp *ControlPlane
		cp, err = start(ctx, assets, opts)
		if err == nil {
			return cp, nil
		}
		if !errors.Is(err, errPortInUse) || ctx.Err() != nil {
			break
		}
	}
	return nil, err
}

var errPortInUse = errors.New("port already in use")

func start(ctx context.Context, assets string, opts Options) (cp *ControlPlane, err error) {
	dir, err := os.MkdirTemp("", "csi-sidecars-controlplane-")
	if err != nil {
		return nil, fmt.Errorf("control plane: create temporary directory: %w", err)
	}
	cp = &ControlPlane{dir: dir, logDir: opts.LogDir, readyTimeout: opts.ReadyTimeout}
	if cp.logDir == "" {
		cp.logDir = filepath.Join(dir, "logs")
	}
	defer func() {
		if err != nil {
			cp.abort(opts.LogDir == "")
			cp = nil
		}
	}()
	if err := os.MkdirAll(cp.logDir, 0o755); err != nil {
		return cp, fmt.Errorf("control plane: create log directory: %w", err)
	}

	ports, err := freePorts(3)
	if err != nil {
		return cp, err
	}
	etcdClient, etcdPeer, securePort := ports[0], ports[1], ports[2]
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdClient)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(etcdPeer)
	cp.url = "https://127.0.0.1:" + strconv.Itoa(securePort)

	cp.etcdURL = etcdURL
	cp.etcdPath = filepath.Join(assets, "etcd")
	cp.etcdArgs = []string{
		"--name", "controlplane",
		"--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", etcdURL,
		"--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL,
		"--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "controlplane=" + peerURL,
		// Durability is pointless for throw-away test data, and fsync is what
		// makes etcd slow on shared CI disks.
		"--unsafe-no-fsync",
		// A lone member still waits out most of an election timeout before it
		// leads: ~700ms with the 100/1000ms defaults, ~100ms with these. There
		// are no peers, so short timeouts cannot cause spurious elections.
		"--heartbeat-interval", "10",
		"--election-timeout", "100",
		"--log-level", "warn",
	}
	etcd, err := cp.startEtcdProcess()
	if err != nil {
		return cp, err
	}

	readyCtx, cancel := context.WithTimeout(ctx, opts.ReadyTimeout)
	defer cancel()

	// The apiserver would retry a missing etcd, but waiting here turns an etcd
	// failure into an error about etcd instead of a vague apiserver timeout.
	httpClient := &http.Client{Timeout: 2 * time.Second}
	if err := waitHTTP(readyCtx, httpClient, etcdURL+"/health", "", etcd); err != nil {
		return cp, cp.startError("etcd", etcd, err)
	}

	apiArgs, err := cp.writeAPIServerFiles(etcdURL, securePort)
	if err != nil {
		return cp, err
	}
	cp.apiserverPath = filepath.Join(assets, "kube-apiserver")
	cp.apiserverArgs = append(apiArgs, opts.APIServerArgs...)
	// cp is not shared yet, but the lock keeps the rule simple: apiserver
	// is only ever touched under mu.
	cp.mu.Lock()
	cp.apiserver, err = cp.startAPIServerProcess()
	apiserver := cp.apiserver
	cp.mu.Unlock()
	if err != nil {
		return cp, err
	}
	if err := cp.waitAPIServerReady(readyCtx, apiserver); err != nil {
		return cp, err
	}

	// Self-signed by the apiserver at start-up: leaf certificate followed by
	// its CA, valid for 127.0.0.1 because that is the bind address.
	cp.caData, err = os.ReadFile(filepath.Join(dir, "certs", "apiserver.crt"))
	if err != nil {
		return cp, fmt.Errorf("control plane: read apiserver serving certificate: %w", err)
	}
	cp.kubeconfig = filepath.Join(dir, "kubeconfig")
	if err := cp.WriteKubeconfig(cp.kubeconfig, cp.token); err != nil {
		return cp, err
	}
	if err := cp.ensureNamespaces(readyCtx, metav1.NamespaceDefault, metav1.NamespaceSystem); err != nil {
		return cp, cp.startError("kube-apiserver", cp.apiserver, err)
	}
	return cp, nil
}

// writeAPIServerFiles writes the token file and the ServiceAccount key and
// returns the kube-apiserver arguments that use them.
func (cp *ControlPlane) writeAPIServerFiles(etcdURL string, securePort int) ([]string, error) {
	token, err := randomToken()
	if err != nil {
		return nil, err
	}
	cp.token = token
	tokenFile := filepath.Join(cp.dir, "tokens.csv")
	// Format: token,user,uid,"group1,group2".
	if err := os.WriteFile(tokenFile, []byte(token+","+adminUser+",admin-uid,system:masters\n"), 0o600); err != nil {
		return nil, fmt.Errorf("control plane: write token file: %w", err)
	}

	// One RSA key both signs ServiceAccount tokens and (its public half)
	// verifies them; the apiserver accepts a private key for the latter.
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, fmt.Errorf("control plane: generate ServiceAccount signing key: %w", err)
	}
	saKeyFile := filepath.Join(cp.dir, "sa.key")
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)})
	if err := os.WriteFile(saKeyFile, keyPEM, 0o600); err != nil {
		return nil, fmt.Errorf("control plane: write ServiceAccount signing key: %w", err)
	}

	return []string{
		"--etcd-servers", etcdURL,
		"--bind-address", "127.0.0.1",
		"--secure-port", strconv.Itoa(securePort),
		// Without a certificate the apiserver self-signs one into cert-dir.
		"--cert-dir", filepath.Join(cp.dir, "certs"),
		"--token-auth-file", tokenFile,
		"--authorization-mode", "RBAC",
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", saKeyFile,
		"--service-account-signing-key-file", saKeyFile,
		"--service-cluster-ip-range", "10.0.0.0/24",
		// Otherwise the apiserver advertises the host's primary address, which
		// fails on hosts without a default route. Advertising loopback in turn
		// makes the default endpoint reconciler refuse to start, and there is
		// no in-cluster client that needs the "kubernetes" Endpoints anyway.
		"--advertise-address", "127.0.0.1",
		"--endpoint-reconciler-type", "none",
		// CSI node plugins are privileged; let tests create such manifests.
		"--allow-privileged=true",
		// On SIGTERM (StopAPIServer), end open watches at once, so clients
		// see them close and re-list, as behind any well-configured
		// apiserver. Without it the apiserver waits up to --request-timeout
		// (60s) for watch connections to go idle, longer than StopAPIServer's
		// 30s before SIGKILL, and every sidecar holds watches.
		"--shutdown-watch-termination-grace-period", "5s",
	}, nil
}

func randomToken() (string, error) {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("control plane: generate admin token: %w", err)
	}
	return fmt.Sprintf("%x", b), nil
}

// freePorts reserves n distinct loopback ports. They are released before the
// children bind them; Start retries if one was taken meanwhile.
func freePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("control plane: find a free port: %w", err)
		}
		// Keep all listeners open until every port is known, so the same port
		// is not returned twice.
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// waitHTTP polls url (with token as bearer token, if any) until it answers
// 200, ctx expires, or one of the processes exits (which it reports at once
// instead of waiting out ctx).
func waitHTTP(ctx context.Context, client *http.Client, url, token string, procs ...*process) error {
	ticker := time.NewTicker(100 * time.Millisecond)
	defer ticker.Stop()
	var last string
	for {
		result := probeOnce(ctx, client, url, token)
		if result == "" {
			return nil
		}
		// A probe cut short by the deadline says nothing; keep the one before.
		if last == "" || ctx.Err() == nil {
			last = result
		}
		for _, p := range procs {
			select {
			case <-p.done:
				return fmt.Errorf("%s exited before %s was ready: %w", p.name, url, p.waitErr)
			default:
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not ready (last result: %s): %w", url, last, ctx.Err())
		case <-ticker.C:
		}
	}
}

// probeOnce returns "" when url answers 200, else a short description.
func probeOnce(ctx context.Context, client *http.Client, url, token string) string {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err.Error()
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		return ""
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<10))
	// A failing /readyz lists every check; "[-]" marks the ones failing.
	var failing []string
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "[-]") {
			failing = append(failing, line)
		}
	}
	if len(failing) == 0 {
		failing = []string{strings.TrimSpace(string(body))}
	}
	return fmt.Sprintf("HTTP %d: %s", resp.StatusCode, strings.Join(failing, "; "))
}

// ensureNamespaces waits for the apiserver's system-namespaces controller to
// create the namespaces, creating them itself if they are still missing, so
// tests never race that controller.
func (cp *ControlPlane) ensureNamespaces(ctx context.Context, names ...string) error {
	client, err := kubernetes.NewForConfig(cp.Config())
	if err != nil {
		return fmt.Errorf("control plane: create client: %w", err)
	}
	for _, name := range names {
		for {
			_, err := client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				_, err = client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
				if apierrors.IsAlreadyExists(err) {
					err = nil
				}
			}
			if err == nil {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("ensure namespace %q: %w (context: %v)", name, err, ctx.Err())
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	return nil
}

// waitAPIServerReady waits for p, a kube-apiserver just started, to answer
// /readyz, or reports why it did not with the tail of its log.
func (cp *ControlPlane) waitAPIServerReady(ctx context.Context, p *process) error {
	// The serving certificate cannot be trusted before it exists, so the probe
	// skips verification; everything after it verifies against the real CA.
	// It still sends the admin token: anonymous requests get a bare 403 until
	// RBAC is bootstrapped, while system:masters sees which checks fail. The
	// token is throw-away and only goes to the loopback port picked by Start.
	probe := &http.Client{
		Timeout:   2 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}, //nolint:gosec // readiness probe only, see above
	}
	defer probe.CloseIdleConnections()
	if err := waitHTTP(ctx, probe, cp.url+"/readyz", cp.token, p, cp.etcdProcess()); err != nil {
		return cp.startError("kube-apiserver", p, err)
	}
	return nil
}

// startError wraps err with where to look: the log file path and its tail.
// Only what p itself logged counts, not earlier runs appended to the same log.
func (cp *ControlPlane) startError(what string, p *process, err error) error {
	tail := tailLog(p.logPath, p.logOffset, logTailLines)
	wrapped := fmt.Errorf("control plane: %s did not become ready: %w\nlogs: %s (etcd.log, apiserver.log)\nlast lines of %s (klog info and warnings omitted):\n%s",
		what, err, cp.logDir, p.logPath, tail)
	if strings.Contains(tail, "address already in use") {
		return fmt.Errorf("%w: %w", errPortInUse, wrapped)
	}
	return wrapped
}

// tailLog returns the last n lines of a log from byte offset from on, without
// klog info and warning lines when there is anything else: kube-apiserver logs
// ~50 harmless warnings at start-up that would push the one error line out of
// the tail.
func tailLog(path string, from int64, n int) string {
	data, err := readFrom(path, from)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	all := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	var kept []string
	for _, line := range all {
		if !isKlogInfoOrWarning(line) {
			kept = append(kept, line)
		}
	}
	if len(kept) == 0 {
		kept = all
	}
	if len(kept) > n {
		kept = kept[len(kept)-n:]
	}
	return strings.Join(kept, "\n")
}

func readFrom(path string, offset int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return nil, err
	}
	return io.ReadAll(f)
}

// isKlogInfoOrWarning matches klog's header, e.g. "I1130 01:14:39.015667".
func isKlogInfoOrWarning(line string) bool {
	if len(line) < 5 || (line[0] != 'I' && line[0] != 'W') {
		return false
	}
	for _, c := range line[1:5] {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// Config returns an admin (system:masters) client configuration that verifies
// the apiserver's serving certificate. Each call returns a fresh copy.
func (cp *ControlPlane) Config() *rest.Config {
	return cp.ConfigWithToken(cp.token)
}

// ConfigWithToken is Config authenticating with another bearer token, e.g. a
// ServiceAccount token from TokenRequest, so RBAC applies to it.
func (cp *ControlPlane) ConfigWithToken(token string) *rest.Config {
	return &rest.Config{
		Host:            cp.url,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: bytes.Clone(cp.caData)},
		// Tests create objects in bursts; client-side throttling only slows them.
		QPS:   1000,
		Burst: 2000,
	}
}

// URL returns the apiserver's https URL on 127.0.0.1.
func (cp *ControlPlane) URL() string { return cp.url }

// KubeconfigPath returns an admin kubeconfig file, for child processes started
// with --kubeconfig. It is removed by Stop.
func (cp *ControlPlane) KubeconfigPath() string { return cp.kubeconfig }

// Dir returns the control plane's temporary directory, removed by Stop. Tests
// may put their own scratch files there.
func (cp *ControlPlane) Dir() string { return cp.dir }

// LogDir returns the folder holding etcd.log and apiserver.log.
func (cp *ControlPlane) LogDir() string { return cp.logDir }

// WriteKubeconfig writes a self-contained kubeconfig (CA embedded) for the
// given bearer token to path, with mode 0600 since it holds a credential.
func (cp *ControlPlane) WriteKubeconfig(path, token string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["controlplane"] = &clientcmdapi.Cluster{Server: cp.url, CertificateAuthorityData: cp.caData}
	cfg.AuthInfos["user"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["controlplane"] = &clientcmdapi.Context{Cluster: "controlplane", AuthInfo: "user", Namespace: metav1.NamespaceDefault}
	cfg.CurrentContext = "controlplane"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return fmt.Errorf("control plane: write kubeconfig %s: %w", path, err)
	}
	return nil
}

// Stop kills kube-apiserver (the current one, after StartAPIServer), then
// etcd, waits for both to exit and removes the temporary directory. It is
// idempotent: later calls return the first call's result. A nil ControlPlane
// is a no-op, so a deferred Stop is safe after a failed Start.
//
// Stop does not wait for a StopAPIServer or StartAPIServer running
// concurrently: it kills their kube-apiserver, and they return.
func (cp *ControlPlane) Stop() error {
	if cp == nil {
		return nil
	}
	cp.stopOnce.Do(func() {
		cp.mu.Lock()
		cp.stopped = true
		apiserver, etcd := cp.apiserver, cp.etcd
		cp.mu.Unlock()
		// apiserver first, so it does not log a storm of etcd errors.
		var errs []error
		for _, p := range []*process{apiserver, etcd} {
			if err := p.stop(); err != nil {
				errs = append(errs, err)
			}
		}
		if err := os.RemoveAll(cp.dir); err != nil {
			errs = append(errs, fmt.Errorf("control plane: remove %s: %w", cp.dir, err))
		}
		cp.stopErr = errors.Join(errs...)
	})
	return cp.stopErr
}

// abort cleans up after a failed start. The logs are what explain the
// failure, so when they live in the temporary directory everything but them
// is removed.
func (cp *ControlPlane) abort(logsInTempDir bool) {
	cp.mu.Lock()
	apiserver, etcd := cp.apiserver, cp.etcd
	cp.mu.Unlock()
	for _, p := range []*process{apiserver, etcd} {
		_ = p.stop() // the start error matters more than a kill error
	}
	if !logsInTempDir {
		_ = os.RemoveAll(cp.dir)
		return
	}
	entries, _ := os.ReadDir(cp.dir)
	for _, e := range entries {
		if e.Name() != filepath.Base(cp.logDir) {
			_ = os.RemoveAll(filepath.Join(cp.dir, e.Name()))
		}
	}
}

// process is one child. Its goroutine is locked to an OS thread for the
// child's whole life because Pdeathsig fires when the parent *thread* exits,
// not the process: an unlocked thread could be retired by the Go runtime
// (after some other goroutine's LockOSThread) and take the child with it.
type process struct {
	name      string
	logPath   string
	logOffset int64 // size of the log when this child started
	pid       int
	done      chan struct{} // closed once the child has been waited for
	waitErr   error         // valid after done is closed

	// termOnce sends SIGTERM at most once: kube-apiserver takes a second
	// one as a demand to exit at once, skipping its graceful shutdown.
	termOnce sync.Once
	termErr  error
}

// withoutMutationDetector is env without client-go's cache mutation detector, which `make
// test` turns on to check our sidecars: the control plane's processes are upstream's, whose
// caches are not under test (upstream's snapshot-controller v8.7.0 writes into its cached
// VolumeGroupSnapshotContent when a group snapshot is deleted, and the detector would make
// it panic).
func withoutMutationDetector(env []string) []string {
	out := make([]string, 0, len(env))
	for _, kv := range env {
		if !strings.HasPrefix(kv, "KUBE_CACHE_MUTATION_DETECTOR=") {
			out = append(out, kv)
		}
	}
	return out
}

func startProcess(path, logPath string, args ...string) (*process, error) {
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("control plane: open log %s: %w", logPath, err)
	}
	offset, err := logFile.Seek(0, io.SeekEnd)
	if err != nil {
		logFile.Close()
		return nil, fmt.Errorf("control plane: open log %s: %w", logPath, err)
	}
	p := &process{name: filepath.Base(path), logPath: logPath, logOffset: offset, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// Deliberately never unlocked: when this goroutine returns the thread
		// exits, which is fine since the child is gone by then.
		defer close(p.done)
		defer logFile.Close()

		cmd := exec.Command(path, args...)
		cmd.Env = withoutMutationDetector(os.Environ())
		// A file (not a pipe) as output means Wait needs no copying goroutine
		// and the log survives us.
		cmd.Stdout = logFile
		cmd.Stderr = logFile
		cmd.SysProcAttr = sysProcAttr()
		if err := cmd.Start(); err != nil {
			started <- fmt.Errorf("control plane: start %s: %w", path, err)
			return
		}
		p.pid = cmd.Process.Pid
		started <- nil
		p.waitErr = cmd.Wait()
	}()
	if err := <-started; err != nil {
		<-p.done
		return nil, err
	}
	return p, nil
}

// stop kills the child's process group and waits for it. A graceful
// SIGTERM would buy nothing when all state is thrown away, and costs about a
// second of kube-apiserver shutdown per test package; terminate is for when
// the shutdown itself is under test. A nil process is a no-op, which keeps
// Stop simple after a partial start.
func (p *process) stop() error {
	if p == nil {
		return nil
	}
	select {
	case <-p.done:
		return nil // already exited (crashed, or stopped before)
	default:
	}
	// Negative pid: the whole process group, see sysProcAttr. ESRCH means it
	// exited between the check above and now; p.done is about to close.
	if err := syscall.Kill(-p.pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("control plane: kill %s (pid %d): %w", p.name, p.pid, err)
	}
	<-p.done
	return nil
}

// terminate sends SIGTERM to the child's process group, as a kubelet or
// systemd stopping it would, and waits up to grace for it to exit before
// falling back to stop. Concurrent calls send one SIGTERM and all wait; a
// concurrent stop cuts the wait short.
func (p *process) terminate(grace time.Duration) error {
	if p == nil {
		return nil
	}
	select {
	case <-p.done:
		return nil
	default:
	}
	p.termOnce.Do(func() {
		if err := syscall.Kill(-p.pid, syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
			p.termErr = fmt.Errorf("control plane: terminate %s (pid %d): %w", p.name, p.pid, err)
		}
	})
	if p.termErr != nil {
		return p.termErr
	}
	timer := time.NewTimer(grace)
	defer timer.Stop()
	select {
	case <-p.done:
		return nil
	case <-timer.C:
		// Stopped either way; a slow shutdown is the apiserver's business
		// and its log says why.
		return p.stop()
	}
}
