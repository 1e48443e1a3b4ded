package controlplane

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

func TestAssetsMissingBinaries(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(AssetsEnv, dir)
	_, err := Assets()
	if err == nil {
		t.Fatal("Assets() succeeded on an empty folder")
	}
	for _, want := range []string{"make testenv", filepath.Join(dir, "etcd"), AssetsEnv} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Assets() error %q does not mention %q", err, want)
		}
	}

	// Both present and executable: the folder is returned as is.
	for _, bin := range []string{"etcd", "kube-apiserver"} {
		if err := os.WriteFile(filepath.Join(dir, bin), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	got, err := Assets()
	if err != nil || got != dir {
		t.Fatalf("Assets() = %q, %v; want %q, nil", got, err, dir)
	}
}

func TestAssetsDefaultFolder(t *testing.T) {
	t.Setenv(AssetsEnv, "")
	cache := t.TempDir()
	t.Setenv("XDG_CACHE_HOME", cache)
	_, err := Assets()
	want := filepath.Join(cache, "csi-sidecars", "k8s-"+KubernetesVersion)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("Assets() error = %v; want it to name the default folder %s", err, want)
	}
}

func TestTailLogOmitsKlogNoise(t *testing.T) {
	path := filepath.Join(t.TempDir(), "apiserver.log")
	log := "I1130 01:14:39.015667    5718 handler.go:309] Adding GroupVersion\n" +
		"E1130 01:14:39.023797    5718 run.go:72] \"command failed\"\n" +
		"W1130 01:14:39.015671    5718 genericapiserver.go:798] Skipping API\n"
	if err := os.WriteFile(path, []byte(log), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := tailLog(path, 0, 5); got != `E1130 01:14:39.023797    5718 run.go:72] "command failed"` {
		t.Errorf("tailLog = %q, want only the error line", got)
	}
	// Only info lines: better than nothing.
	if err := os.WriteFile(path, []byte("I1130 a\nI1130 b\nI1130 c\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := tailLog(path, 0, 2); got != "I1130 b\nI1130 c" {
		t.Errorf("tailLog = %q, want the last two lines", got)
	}
	// From an offset: an earlier run's lines in the same log do not count.
	if got := tailLog(path, int64(len("I1130 a\n")), 5); got != "I1130 b\nI1130 c" {
		t.Errorf("tailLog from offset = %q, want the lines after it", got)
	}
}

func TestStopNil(t *testing.T) {
	var cp *ControlPlane
	if err := cp.Stop(); err != nil {
		t.Errorf("nil Stop: %v", err)
	}
}

// requireAssets fails (not skips) without binaries, like Shared.Main; -short skips, as there.
func requireAssets(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: not starting kube-apiserver and etcd")
	}
	if os.Getenv(SkipEnv) == "1" {
		t.Skip(SkipEnv + "=1: not starting kube-apiserver and etcd")
	}
	if _, err := Assets(); err != nil {
		t.Fatal(err)
	}
}

// A kube-apiserver that exits at once must be reported at once, with its log.
func TestStartReportsEarlyExit(t *testing.T) {
	requireAssets(t)
	logDir := t.TempDir()
	began := time.Now()
	cp, err := Start(t.Context(), Options{LogDir: logDir, APIServerArgs: []string{"--no-such-flag"}})
	if err == nil {
		_ = cp.Stop()
		t.Fatal("Start succeeded with an unknown kube-apiserver flag")
	}
	t.Logf("error after %s:\n%v", time.Since(began), err)
	if time.Since(began) > 20*time.Second {
		t.Errorf("early exit took %s to be noticed; it should not wait for the ready timeout", time.Since(began))
	}
	for _, want := range []string{"exited", filepath.Join(logDir, "apiserver.log"), "no-such-flag"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q", want)
		}
	}
}

func TestControlPlane(t *testing.T) {
	requireAssets(t)
	ctx := t.Context()

	began := time.Now()
	cp, err := Start(ctx, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("started in %s at %s", time.Since(began).Round(time.Millisecond), cp.URL())
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = cp.Stop()
		}
	})

	admin, err := kubernetes.NewForConfig(cp.Config())
	if err != nil {
		t.Fatal(err)
	}

	t.Run("namespaces exist", func(t *testing.T) {
		for _, ns := range []string{metav1.NamespaceDefault, metav1.NamespaceSystem} {
			if _, err := admin.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); err != nil {
				t.Errorf("namespace %s: %v", ns, err)
			}
		}
	})

	t.Run("configmap round trip", func(t *testing.T) {
		in := &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: "roundtrip", Namespace: metav1.NamespaceDefault},
			Data:       map[string]string{"key": "value"},
		}
		if _, err := admin.CoreV1().ConfigMaps(in.Namespace).Create(ctx, in, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create: %v", err)
		}
		out, err := admin.CoreV1().ConfigMaps(in.Namespace).Get(ctx, in.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get: %v", err)
		}
		if out.Data["key"] != "value" {
			t.Errorf("data = %v, want key=value", out.Data)
		}
	})

	t.Run("admin kubeconfig", func(t *testing.T) {
		cfg, err := clientcmd.BuildConfigFromFlags("", cp.KubeconfigPath())
		if err != nil {
			t.Fatal(err)
		}
		if cfg.Insecure || len(cfg.CAData) == 0 {
			t.Errorf("kubeconfig does not verify the server: insecure=%v, %d bytes of CA", cfg.Insecure, len(cfg.CAData))
		}
		client, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.CoreV1().ConfigMaps(metav1.NamespaceDefault).Get(ctx, "roundtrip", metav1.GetOptions{}); err != nil {
			t.Errorf("get via kubeconfig: %v", err)
		}
	})

	t.Run("rbac restricts service account kubeconfig", func(t *testing.T) {
		testRBAC(t, cp, admin)
	})

	apiserverPID, etcdPID := cp.apiserver.pid, cp.etcd.pid
	t.Logf("memory: kube-apiserver %s, etcd %s", rss(apiserverPID), rss(etcdPID))

	began = time.Now()
	if err := cp.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	stopped = true
	t.Logf("stopped in %s", time.Since(began).Round(time.Millisecond))
	for name, pid := range map[string]int{"kube-apiserver": apiserverPID, "etcd": etcdPID} {
		// Stop has reaped them, so neither the pids nor their process groups
		// (pgid == pid, see sysProcAttr) exist any more.
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("%s (pid %d) still exists after Stop: kill(0) = %v", name, pid, err)
		}
		if err := syscall.Kill(-pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("process group of %s (%d) still exists after Stop: kill(0) = %v", name, pid, err)
		}
	}
	if _, err := os.Stat(cp.Dir()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("temporary directory %s still exists after Stop: %v", cp.Dir(), err)
	}
	if err := cp.Stop(); err != nil {
		t.Errorf("second Stop: %v", err)
	}
}

// testRBAC proves that a kubeconfig for a ServiceAccount token is subject to
// RBAC: forbidden to list Secrets until a RoleBinding grants it, and then only
// in that namespace.
func testRBAC(t *testing.T, cp *ControlPlane, admin kubernetes.Interface) {
	ctx := t.Context()
	const ns, sa = "rbac-test", "reader"
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tr, err := admin.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("TokenRequest: %v", err)
	}

	path := filepath.Join(t.TempDir(), "reader.kubeconfig")
	if err := cp.WriteKubeconfig(path, tr.Status.Token); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("kubeconfig %s: mode %v, %v; want 0600, it holds a token", path, fi.Mode().Perm(), err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		t.Fatal(err)
	}
	reader, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}

	review, err := reader.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("SelfSubjectReview: %v", err)
	}
	if want := "system:serviceaccount:" + ns + ":" + sa; review.Status.UserInfo.Username != want {
		t.Fatalf("token authenticates as %q, want %q", review.Status.UserInfo.Username, want)
	}

	if _, err := reader.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("listing secrets before any RoleBinding: err = %v, want Forbidden", err)
	}

	role := &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "secret-reader", Namespace: ns},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "list"}}},
	}
	if _, err := admin.RbacV1().Roles(ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "secret-reader", Namespace: ns},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: role.Name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: sa, Namespace: ns}},
	}
	if _, err := admin.RbacV1().RoleBindings(ns).Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// The RBAC authorizer reads Roles through an informer, so the grant takes
	// effect a moment after the create returns.
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err = reader.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
		if err == nil || !apierrors.IsForbidden(err) || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("listing secrets after the RoleBinding: %v", err)
	}
	if _, err := reader.CoreV1().Secrets(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("listing secrets in another namespace: err = %v, want Forbidden", err)
	}
}

const helperEnv = "CONTROLPLANE_TEST_HELPER"

// TestChildrenDieWithTestBinary checks the Pdeathsig promise: a test binary
// killed without a chance to call Stop takes etcd and kube-apiserver with it.
// It re-runs this test binary as the victim.
func TestChildrenDieWithTestBinary(t *testing.T) {
	if os.Getenv(helperEnv) == "1" {
		runVictim()
		return
	}
	requireAssets(t)

	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestChildrenDieWithTestBinary$")
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var apiserverPID, etcdPID int
	var dir string
	scanner := bufio.NewScanner(out)
	for scanner.Scan() {
		if _, err := fmt.Sscanf(scanner.Text(), "PIDS %d %d %s", &apiserverPID, &etcdPID, &dir); err == nil {
			break
		}
	}
	if apiserverPID == 0 {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("victim did not report its control plane (scan error: %v)", scanner.Err())
	}
	// SIGKILL cannot be caught: no Stop, no cleanup, only the kernel.
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	// Stop never ran, so the temporary directory is ours to remove.
	t.Cleanup(func() { _ = os.RemoveAll(dir) })

	deadline := time.Now().Add(10 * time.Second)
	for name, pid := range map[string]int{"kube-apiserver": apiserverPID, "etcd": etcdPID} {
		for alive(pid) {
			if time.Now().After(deadline) {
				t.Errorf("%s (pid %d) survived its parent", name, pid)
				_ = syscall.Kill(-pid, syscall.SIGKILL)
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// runVictim starts a control plane, reports it, and waits to be killed.
func runVictim() {
	cp, err := Start(context.Background(), Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("PIDS %d %d %s\n", cp.apiserver.pid, cp.etcd.pid, cp.Dir())
	time.Sleep(time.Minute)
	_ = cp.Stop()
	os.Exit(1) // the parent should have killed us long ago
}

// alive reports whether pid runs. A zombie counts as dead: it is no longer
// running, and reaping it is up to whoever inherited it (PID 1 in a container
// may never do so).
func alive(pid int) bool {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return syscall.Kill(pid, 0) == nil // no /proc: best effort
	}
	// Format: pid (comm) state ...; comm may contain spaces and parentheses.
	rest := string(stat[strings.LastIndexByte(string(stat), ')')+1:])
	fields := strings.Fields(rest)
	return len(fields) > 0 && fields[0] != "Z" && fields[0] != "X"
}

// rss reads a process's resident memory for the test log (Linux only).
func rss(pid int) string {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return "unknown"
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

// startForTest starts a control plane that t's cleanup stops.
func startForTest(t *testing.T) *ControlPlane {
	t.Helper()
	requireAssets(t)
	began := time.Now()
	cp, err := Start(t.Context(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("started in %s at %s", time.Since(began).Round(time.Millisecond), cp.URL())
	t.Cleanup(func() { _ = cp.Stop() })
	return cp
}

// currentAPIServer returns the kube-apiserver process the control plane
// holds now.
func currentAPIServer(cp *ControlPlane) *process {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return cp.apiserver
}

// servedCertificate returns the DER of the certificate kube-apiserver serves.
func servedCertificate(t *testing.T, cp *ControlPlane) []byte {
	t.Helper()
	conn, err := tls.Dial("tcp", strings.TrimPrefix(cp.URL(), "https://"), &tls.Config{InsecureSkipVerify: true}) //nolint:gosec // only reads the certificate
	if err != nil {
		t.Fatalf("TLS dial %s: %v", cp.URL(), err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].Raw
}

// requireGone fails t unless pid and its process group have exited.
func requireGone(t *testing.T, what string, pid int) {
	t.Helper()
	if alive(pid) {
		t.Errorf("%s (pid %d) still runs", what, pid)
	}
	if err := syscall.Kill(-pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("process group of %s (%d) still exists: kill(0) = %v", what, pid, err)
	}
}

// A restart keeps the data (etcd), the URL and the serving certificate, so a
// client made before it carries on with the same rest.Config, while its
// watches end as they would with a real apiserver restart.
func TestRestartAPIServer(t *testing.T) {
	cp := startForTest(t)
	ctx := t.Context()

	cfg := cp.Config()
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cms := client.CoreV1().ConfigMaps(metav1.NamespaceDefault)
	if _, err := cms.Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "survivor"},
		Data:       map[string]string{"key": "before"},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	watcher, err := cms.Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer watcher.Stop()

	certFile := filepath.Join(cp.Dir(), "certs", "apiserver.crt")
	certBefore, err := os.ReadFile(certFile)
	if err != nil {
		t.Fatal(err)
	}
	servedBefore := servedCertificate(t, cp)
	old := currentAPIServer(cp)

	began := time.Now()
	if err := cp.RestartAPIServer(ctx); err != nil {
		t.Fatalf("RestartAPIServer: %v", err)
	}
	t.Logf("restarted in %s", time.Since(began).Round(time.Millisecond))

	if old.waitErr != nil {
		t.Errorf("old kube-apiserver did not shut down cleanly on SIGTERM: %v", old.waitErr)
	}
	requireGone(t, "old kube-apiserver", old.pid)
	current := currentAPIServer(cp)
	if current.pid == old.pid {
		t.Fatalf("kube-apiserver pid %d unchanged by restart", old.pid)
	}

	// The watch from before ended: that is what sidecars see.
	closed := time.After(10 * time.Second)
drain:
	for {
		select {
		case _, ok := <-watcher.ResultChan():
			if !ok {
				break drain
			}
		case <-closed:
			t.Fatal("watch opened before the restart is still open 10s after it")
		}
	}

	// Same client, same rest.Config: TLS still verifies, data survived.
	got, err := cms.Get(ctx, "survivor", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get after restart with the client from before: %v", err)
	}
	if got.Data["key"] != "before" {
		t.Errorf("data after restart = %v, want key=before", got.Data)
	}
	got.Data["key"] = "after"
	if _, err := cms.Update(ctx, got, metav1.UpdateOptions{}); err != nil {
		t.Errorf("update after restart: %v", err)
	}
	if _, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "newborn"}}, metav1.CreateOptions{}); err != nil {
		t.Errorf("create after restart: %v", err)
	}

	// The admin kubeconfig written at the first start still works.
	kcfg, err := clientcmd.BuildConfigFromFlags("", cp.KubeconfigPath())
	if err != nil {
		t.Fatal(err)
	}
	kclient, err := kubernetes.NewForConfig(kcfg)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := kclient.CoreV1().ConfigMaps(metav1.NamespaceDefault).Get(ctx, "survivor", metav1.GetOptions{}); err != nil || got.Data["key"] != "after" {
		t.Errorf("get via kubeconfig after restart: %v, %v", got.Data, err)
	}

	// kube-apiserver reused the certificate it generated on the first start.
	certAfter, err := os.ReadFile(certFile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(certBefore, certAfter) {
		t.Errorf("%s was rewritten by the restart", certFile)
	}
	if !bytes.Equal(servedBefore, servedCertificate(t, cp)) {
		t.Errorf("kube-apiserver serves another certificate after the restart")
	}

	log, err := os.ReadFile(filepath.Join(cp.LogDir(), "apiserver.log"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(log), "starting kube-apiserver again"); n != 1 {
		t.Errorf("apiserver.log has %d restart markers, want 1 (appended, not truncated)", n)
	}
	if !strings.Contains(string(log), "Generated self-signed cert") {
		t.Errorf("apiserver.log lost the first run's output")
	}

	if err := cp.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	requireGone(t, "restarted kube-apiserver", current.pid)
	requireGone(t, "etcd", cp.etcd.pid)
}

// Requests fail while kube-apiserver is stopped and work once it is started;
// a port taken meanwhile is reported as such.
func TestStopStartAPIServer(t *testing.T) {
	cp := startForTest(t)
	ctx := t.Context()
	cfg := cp.Config()
	cfg.Timeout = 5 * time.Second
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	get := func() error {
		_, err := client.CoreV1().Namespaces().Get(ctx, metav1.NamespaceDefault, metav1.GetOptions{})
		return err
	}

	// Concurrent stops: one SIGTERM, so a graceful shutdown (a second
	// SIGTERM makes kube-apiserver exit 1 at once).
	first := currentAPIServer(cp)
	began := time.Now()
	errs := make(chan error, 3)
	for range 3 {
		go func() { errs <- cp.StopAPIServer() }()
	}
	for range 3 {
		if err := <-errs; err != nil {
			t.Errorf("StopAPIServer: %v", err)
		}
	}
	t.Logf("stopped in %s", time.Since(began).Round(time.Millisecond))
	if first.waitErr != nil {
		t.Errorf("kube-apiserver did not exit cleanly on SIGTERM: %v", first.waitErr)
	}
	requireGone(t, "kube-apiserver", first.pid)
	if !alive(cp.etcd.pid) {
		t.Fatal("etcd stopped with kube-apiserver")
	}
	if err := get(); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("request while stopped: err = %v, want connection refused", err)
	}
	if err := cp.StopAPIServer(); err != nil {
		t.Errorf("StopAPIServer when stopped: %v", err)
	}

	// Someone else takes the port: a clear error, and the URL stays.
	ln, err := net.Listen("tcp", strings.TrimPrefix(cp.URL(), "https://"))
	if err != nil {
		t.Fatalf("take the apiserver's port: %v", err)
	}
	began = time.Now()
	err = cp.StartAPIServer(ctx)
	ln.Close()
	if err == nil {
		t.Fatal("StartAPIServer succeeded on a port another process listens on")
	}
	t.Logf("port taken: error after %s:\n%v", time.Since(began).Round(time.Millisecond), err)
	if !errors.Is(err, errPortInUse) || !strings.Contains(err.Error(), cp.URL()) || !strings.Contains(err.Error(), "another process took the port") {
		t.Errorf("error does not say that %s is taken", cp.URL())
	}
	if time.Since(began) > 20*time.Second {
		t.Errorf("port in use took %s to be noticed; it should not wait for the ready timeout", time.Since(began))
	}

	began = time.Now()
	if err := cp.StartAPIServer(ctx); err != nil {
		t.Fatalf("StartAPIServer: %v", err)
	}
	t.Logf("started again in %s", time.Since(began).Round(time.Millisecond))
	if err := get(); err != nil {
		t.Errorf("request after StartAPIServer: %v", err)
	}
	if err := cp.StartAPIServer(ctx); err == nil || !strings.Contains(err.Error(), "still running") {
		t.Errorf("StartAPIServer while running: err = %v, want still running", err)
	}

	current := currentAPIServer(cp)
	if err := cp.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	requireGone(t, "kube-apiserver", current.pid)
	if err := cp.StartAPIServer(ctx); err == nil {
		t.Error("StartAPIServer after Stop succeeded")
	}
	if err := cp.StopAPIServer(); err != nil {
		t.Errorf("StopAPIServer after Stop: %v", err)
	}
}

// Stop during StartAPIServer kills the kube-apiserver being started, and
// StartAPIServer returns rather than wait for it.
func TestStopWhileStartingAPIServer(t *testing.T) {
	cp := startForTest(t)
	ctx := t.Context()
	old := currentAPIServer(cp)
	if err := cp.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	started := make(chan error, 1)
	go func() { started <- cp.StartAPIServer(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for currentAPIServer(cp) == old {
		if time.Now().After(deadline) {
			t.Fatal("StartAPIServer did not start a kube-apiserver within 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	starting := currentAPIServer(cp)
	if err := cp.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	select {
	case err := <-started:
		if err == nil {
			t.Log("StartAPIServer was ready before Stop")
		} else if !strings.Contains(err.Error(), "Stop was called") {
			t.Errorf("StartAPIServer interrupted by Stop: %v; want it to say so", err)
		} else {
			t.Logf("StartAPIServer interrupted by Stop: %.120s...", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("StartAPIServer still waits 10s after Stop")
	}
	requireGone(t, "kube-apiserver being started", starting.pid)
}
