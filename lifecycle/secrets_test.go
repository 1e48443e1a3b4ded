package lifecycle

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// A Secret read at -v=10 leaves no trace of its data in the log, in clear, hex or base64,
// while another read at the same verbosity still logs its response body (so the log is
// really at -v=10, and users keep what they rely on).
func TestSecretsAreReadWithoutLoggingTheirBodiesAtAnyVerbosity(t *testing.T) {
	const value = "s3cr3t-value-4711"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/api/v1/namespaces/ns/secrets/creds":
			w.Write([]byte(`{"kind":"Secret","apiVersion":"v1","metadata":{"name":"creds","namespace":"ns"},"data":{"password":"` + base64.StdEncoding.EncodeToString([]byte(value)) + `"},"stringData":{"clear":"` + value + `"}}`))
		case "/api/v1/namespaces/ns/configmaps/plain":
			w.Write([]byte(`{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"plain","namespace":"ns"},"data":{"visible":"not-a-secret-1234"}}`))
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	kube, err := kubernetes.NewForConfig(&rest.Config{Host: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var out bytes.Buffer
	logger := funcr.New(func(prefix, args string) {
		mu.Lock()
		defer mu.Unlock()
		out.WriteString(prefix + " " + args + "\n")
	}, funcr.Options{Verbosity: 10})
	ctx := logr.NewContext(context.Background(), logger)

	s, err := GetSecret(ctx, kube, "ns", "creds")
	if err != nil {
		t.Fatal(err)
	}
	if string(s.Data["password"]) != value {
		t.Fatalf("read %q, want the Secret's value", s.Data["password"])
	}
	if _, err := kube.CoreV1().ConfigMaps("ns").Get(ctx, "plain", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	log := out.String()
	mu.Unlock()
	if !strings.Contains(log, "not-a-secret-1234") {
		t.Fatalf("the ConfigMap's body is not in the -v=10 log; the test does not log at -v=10:\n%s", log)
	}
	for form, v := range map[string]string{
		"clear":  value,
		"base64": base64.StdEncoding.EncodeToString([]byte(value)),
		"hex":    hex.EncodeToString([]byte(value))[:16],
	} {
		if strings.Contains(strings.ReplaceAll(log, " ", ""), v) {
			t.Errorf("the Secret's value is in the log (%s):\n%s", form, log)
		}
	}
}

// Every Secret the product reads goes through GetSecret: no other code of the four sidecars,
// the core or the command reads one (so no flow logs a Secret's body, whichever it is).
func TestNoOtherCodeReadsSecrets(t *testing.T) {
	read := regexp.MustCompile(`\.Secrets\(`)
	for _, dir := range []string{".", "../attacher", "../resizer", "../provisioner", "../snapshotter", "../cmd", "../internal/sidecars"} {
		err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") || path == "secrets.go" {
				return err
			}
			src, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for i, line := range strings.Split(string(src), "\n") {
				if read.MatchString(line) {
					t.Errorf("%s:%d reads Secrets itself; use lifecycle.GetSecret: %s", path, i+1, strings.TrimSpace(line))
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}
