package controlplane

import (
	"bufio"
	"context"
	"errors"
	"fmt"
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
	if got := tailLog(path, 5); got != `E1130 01:14:39.023797    5718 run.go:72] "command failed"` {
		t.Errorf("tailLog = %q, want only the error line", got)
	}
	// Only info lines: better than nothing.
	if err := os.WriteFile(path, []byte("I1130 a\nI1130 b\nI1130 c\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := tailLog(path, 2); got != "I1130 b\nI1130 c" {
		t.Errorf("tailLog = %q, want the last two lines", got)
	}
}

func TestStopNil(t *testing.T) {
	var cp *ControlPlane
	if err := cp.Stop(); err != nil {
		t.Errorf("nil Stop: %v", err)
	}
}

// requireAssets fails (not skips) without binaries, like Shared.Main.
func requireAssets(t *testing.T) {
	t.Helper()
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
