package lifecycle

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

func parse(t *testing.T, args ...string) (*Options, error) {
	t.Helper()
	o := NewOptions()
	o.Getenv = func(string) string { return "" }
	o.Hostname = func() (string, error) { return "node-1.example", nil }
	o.ReadFile = func(string) ([]byte, error) { return nil, errors.New("absent") }
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	fs.SetOutput(&bytes.Buffer{})
	o.AddFlags(fs)
	if err := fs.Parse(NormalizeArgs(args)); err != nil {
		return o, err
	}
	return o, o.Validate()
}

func TestDefaultsMatchUpstream(t *testing.T) {
	o, err := parse(t)
	if err != nil {
		t.Fatal(err)
	}
	checks := []struct {
		name      string
		got, want any
	}{
		{"csi-address", o.CSIAddress, "/run/csi/socket"},
		{"leader-election", o.LeaderElection, false},
		{"leader-election-lease-duration", o.LeaseDuration, 15 * time.Second},
		{"leader-election-renew-deadline", o.RenewDeadline, 10 * time.Second},
		{"leader-election-retry-period", o.RetryPeriod, 5 * time.Second},
		{"kube-api-qps", o.KubeAPIQPS, 5.0},
		{"kube-api-burst", o.KubeAPIBurst, 10},
		{"metrics-path", o.MetricsPath, "/metrics"},
		{"http-endpoint", o.HTTPEndpoint, ""},
		{"drain-timeout", o.DrainTimeout, 20 * time.Second},
		{"max-grpc-log-length", o.MaxGRPCLogLength, -1},
		{"master", o.Master, ""},
		{"enable-pprof", o.EnablePprof, false},
		{"version", o.ShowVersion, false},
		{"leader-election-namespace (derived)", o.LeaderElectionNamespace, "default"},
		{"leader-election-identity (derived, sanitised)", o.LeaderElectionIdentity, "node-1-example"},
		{"ReleaseLeaderElectionOnExit", o.Gates.Enabled(ReleaseLeaderElectionOnExit), true},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s: got %v, want %v", c.name, c.got, c.want)
		}
	}
}

func TestSingleDashSpellingIsAccepted(t *testing.T) {
	o, err := parse(t, "-csi-address=/csi/csi.sock", "-v=5", "-leader-election", "-leader-election-namespace", "kube-system", "-kube-api-qps=20")
	if err != nil {
		t.Fatal(err)
	}
	if o.CSIAddress != "/csi/csi.sock" || !o.LeaderElection || o.LeaderElectionNamespace != "kube-system" || o.KubeAPIQPS != 20 || o.Logging.Verbosity != 5 {
		t.Errorf("single-dash flags not applied: %+v", o)
	}
}

func TestNormalizeArgsLeavesShorthandsAndPositionals(t *testing.T) {
	got := NormalizeArgs([]string{"-v=3", "-h", "attacher", "--timeout=1s", "-timeout=2s", "-volume-name-uuid-length", "-16", "--", "-x-y"})
	want := []string{"-v=3", "-h", "attacher", "--timeout=1s", "--timeout=2s", "--volume-name-uuid-length", "-16", "--", "-x-y"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestBadValuesNameTheFlag(t *testing.T) {
	cases := []struct {
		args []string
		flag string
	}{
		{[]string{"--kube-api-qps=abc"}, "--kube-api-qps"},
		{[]string{"--kube-api-qps=5", "--kube-api-burst=0"}, "--kube-api-burst"},
		{[]string{"--kube-api-burst=-1"}, "--kube-api-burst"},
		{[]string{"--drain-timeout=0s"}, "--drain-timeout"},
		{[]string{"--drain-timeout=soon"}, "--drain-timeout"},
		{[]string{"--http-endpoint=:8080", "--metrics-address=:8081"}, "--metrics-address"},
		{[]string{"--metrics-path=metrics"}, "--metrics-path"},
		{[]string{"--leader-election", "--leader-election-lease-duration=5s"}, "--leader-election-lease-duration"},
		{[]string{"--leader-election", "--leader-election-retry-period=9s"}, "--leader-election-retry-period"},
		{[]string{"--leader-election-labels=novalue"}, "--leader-election-labels"},
		{[]string{"--feature-gates=NoSuchGate=true"}, "NoSuchGate"},
		{[]string{"--logging-format=xml"}, "logging"},
		{[]string{"--csi-address="}, "--csi-address"},
	}
	for _, c := range cases {
		_, err := parse(t, c.args...)
		if err == nil {
			t.Errorf("%v: accepted", c.args)
			continue
		}
		if !strings.Contains(err.Error(), c.flag) {
			t.Errorf("%v: error %q does not name %s", c.args, err, c.flag)
		}
	}
}

// Repeated --leader-election-labels add up, a later key wins, as upstream.
func TestLeaderElectionLabels(t *testing.T) {
	o, err := parse(t, "--leader-election-labels=a:1,b.io/c:two", "--leader-election-labels=d:4,a:one")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"a": "one", "b.io/c": "two", "d": "4"}
	if len(o.LeaderElectionLabels) != len(want) {
		t.Errorf("labels: %v, want %v", o.LeaderElectionLabels, want)
	}
	for k, v := range want {
		if o.LeaderElectionLabels[k] != v {
			t.Errorf("labels: %v, want %v", o.LeaderElectionLabels, want)
		}
	}
}

// client-go reads a QPS of 0 as its default and a negative one as no client-side limit:
// both are accepted, as upstream.
func TestKubeAPIQPSAsClientGoReadsIt(t *testing.T) {
	for _, args := range [][]string{{"--kube-api-qps=0"}, {"--kube-api-qps=-1", "--kube-api-burst=0"}} {
		if _, err := parse(t, args...); err != nil {
			t.Errorf("%v: %v", args, err)
		}
	}
}

// KUBECONFIG is used when --kubeconfig is not given; the flag wins over it.
func TestKubeconfigFromTheEnvironment(t *testing.T) {
	o := NewOptions()
	o.Getenv = func(k string) string { return map[string]string{"KUBECONFIG": "/env/config"}[k] }
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	if o.Kubeconfig != "/env/config" {
		t.Errorf("kubeconfig %q, want the KUBECONFIG environment variable", o.Kubeconfig)
	}
	o = NewOptions()
	o.Getenv = func(k string) string { return map[string]string{"KUBECONFIG": "/env/config"}[k] }
	o.Kubeconfig = "/flag/config"
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	if o.Kubeconfig != "/flag/config" {
		t.Errorf("kubeconfig %q, want the flag's", o.Kubeconfig)
	}
}

func TestNamespaceAndIdentityFallbacks(t *testing.T) {
	o := NewOptions()
	env := map[string]string{"POD_NAMESPACE": "storage", "POD_NAME": "ctrl-0"}
	o.Getenv = func(k string) string { return env[k] }
	o.ReadFile = func(string) ([]byte, error) { return []byte("from-file\n"), nil }
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	if o.LeaderElectionNamespace != "storage" || o.LeaderElectionIdentity != "ctrl-0" {
		t.Errorf("env: got %s %s", o.LeaderElectionNamespace, o.LeaderElectionIdentity)
	}
	o = NewOptions()
	o.Getenv = func(string) string { return "" }
	o.ReadFile = func(string) ([]byte, error) { return []byte("from-file\n"), nil }
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	if o.LeaderElectionNamespace != "from-file" {
		t.Errorf("file: got %s", o.LeaderElectionNamespace)
	}
}

func TestSanitizeNameMatchesUpstream(t *testing.T) {
	for in, want := range map[string]string{
		"external-attacher-leader-hostpath.csi.k8s.io": "external-attacher-leader-hostpath-csi-k8s-io",
		"external-resizer-ebs.csi.aws.com":             "external-resizer-ebs-csi-aws-com",
		"driver_":                                      "driver-X",
		"a/b:c":                                        "a-b-c",
	} {
		if got := SanitizeName(in); got != want {
			t.Errorf("SanitizeName(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestExecuteExitCodes(t *testing.T) {
	root := NewRootCommand("x", "v1.2.3")
	var stderr bytes.Buffer
	if code := Execute(context.Background(), root, []string{"version"}, &stderr); code != ExitOK {
		t.Errorf("version: exit %d", code)
	}
	root = NewRootCommand("x", "v1.2.3")
	if code := Execute(context.Background(), root, []string{"--kube-api-qps=abc", "version"}, &stderr); code != ExitUsage {
		t.Errorf("bad flag: exit %d, want %d", code, ExitUsage)
	}
	if !strings.Contains(stderr.String(), "--kube-api-qps") {
		t.Errorf("stderr does not name the flag: %s", stderr.String())
	}
}

// The flags are refused at start when a leader could fence itself no earlier than a standby
// may take the Lease.
func TestRenewDeadlineMustEndBeforeTheRecordedLeaseDuration(t *testing.T) {
	for _, c := range []struct {
		lease, renew time.Duration
		ok           bool
	}{
		{15 * time.Second, 10 * time.Second, true},
		{6 * time.Second, 4 * time.Second, true},
		{15 * time.Second, 15 * time.Second, false},
		{15500 * time.Millisecond, 15 * time.Second, false}, // the record says 15s
		{15500 * time.Millisecond, 14900 * time.Millisecond, true},
	} {
		o := NewOptions()
		o.LeaderElection = true
		o.LeaseDuration, o.RenewDeadline, o.RetryPeriod = c.lease, c.renew, time.Second
		errs := o.validateLeaderElection()
		if (len(errs) == 0) != c.ok {
			t.Errorf("lease %v renew %v: errors %v, want ok=%v", c.lease, c.renew, errs, c.ok)
		}
	}
}
