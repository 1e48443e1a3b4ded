package livenessprobe

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"google.golang.org/grpc/codes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// process is a livenessprobe hosted in-process, as its subcommand would run it (or in
// combined mode beside others), against the test driver on a UNIX socket.
type process struct {
	backend *testdriver.Backend
	driver  *testdriver.Server
	socket  string
	signals chan os.Signal
	exited  chan int
	// probe is the probe's own address (http://127.0.0.1:<--health-port>).
	probe string
}

// start hosts a livenessprobe with args (its own flags and the shared ones, as the
// subcommand takes them; prefixed with livenessprobe- when others run beside it), on a free
// --health-port unless args name one.
func start(t *testing.T, args []string, others ...lifecycle.Hosted) *process {
	t.Helper()
	backend, err := testdriver.New(testdriver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	p := &process{backend: backend, socket: filepath.Join(t.TempDir(), "csi.sock"),
		signals: make(chan os.Signal, 2), exited: make(chan int, 1)}
	if p.driver, err = backend.Serve(p.socket); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.driver.Stop() })

	s := New()
	opts := lifecycle.NewOptions()
	opts.Getenv = func(string) string { return "" }
	fs := pflag.NewFlagSet("csi-sidecars", pflag.ContinueOnError)
	opts.AddFlags(fs)
	own := pflag.NewFlagSet("livenessprobe", pflag.ContinueOnError)
	s.AddFlags(own)
	portFlag := "--health-port"
	if len(others) == 0 {
		fs.AddFlagSet(own)
	} else {
		// As combined mode: the same values under prefixed names.
		portFlag = "--livenessprobe-health-port"
		own.VisitAll(func(f *pflag.Flag) {
			fs.AddFlag(&pflag.Flag{Name: "livenessprobe-" + f.Name, Usage: f.Usage, Value: f.Value, DefValue: f.DefValue})
		})
	}
	if !slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, portFlag+"=") }) {
		args = append(args, portFlag+"="+freePort(t))
	}
	if err := fs.Parse(append([]string{"--csi-address=" + p.socket}, args...)); err != nil {
		t.Fatal(err)
	}
	if err := opts.Validate(); err != nil {
		t.Fatal(err)
	}
	if err := s.ValidateFlags(); err != nil {
		t.Fatal(err)
	}
	if err := s.ValidateSharedFlags(opts); err != nil {
		t.Fatal(err)
	}
	p.probe = "http://127.0.0.1:" + s.healthPort
	go func() {
		p.exited <- lifecycle.RunWithSignals(t.Context(), opts, p.signals, func(code int) { t.Errorf("exited at once with %d", code) }, append([]lifecycle.Hosted{s}, others...)...)
	}()
	return p
}

// freePort is a TCP port that was free on 127.0.0.1 a moment ago.
func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	return port
}

// get fetches url; err is set when no HTTP answer came.
func get(url string) (int, string, error) { return getWith(http.DefaultClient, url) }

// getWith is get with client.
func getWith(client *http.Client, url string) (int, string, error) {
	rsp, err := client.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer rsp.Body.Close()
	body, err := io.ReadAll(rsp.Body)
	return rsp.StatusCode, string(body), err
}

// waitTimeout bounds every wait: far above what any condition takes, so only a broken
// promise reaches it.
const waitTimeout = 30 * time.Second

// waitFor polls cond until it holds, for at most waitTimeout.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-tick.C:
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// waitForAnswer waits until url answers code and returns the body.
func waitForAnswer(t *testing.T, url string, code int) string {
	t.Helper()
	var got int
	var body string
	var err error
	waitFor(t, fmt.Sprintf("%s to answer %d", url, code), func() bool {
		got, body, err = get(url)
		return err == nil && got == code
	})
	return body
}

// waitForProbe waits until url's /healthz answers 200 "ok" from a Probe of the driver (the
// diagnostics server answers its own /healthz until the probe took it over).
func (p *process) waitForProbe(t *testing.T, url string) {
	t.Helper()
	waitFor(t, url+"/healthz to answer from the driver's Probe", func() bool {
		before := len(p.backend.Calls(testdriver.MethodProbe))
		code, body, err := get(url + "/healthz")
		return err == nil && code == http.StatusOK && body == "ok" && len(p.backend.Calls(testdriver.MethodProbe)) > before
	})
}

func (p *process) exitCode(t *testing.T) int {
	t.Helper()
	select {
	case code := <-p.exited:
		return code
	case <-time.After(waitTimeout):
		t.Fatal("the process did not exit")
		return -1
	}
}

func (p *process) stop(t *testing.T) {
	t.Helper()
	p.signals <- syscall.SIGTERM
	if code := p.exitCode(t); code != lifecycle.ExitOK {
		t.Errorf("exit code %d after SIGTERM, want %d", code, lifecycle.ExitOK)
	}
}

func TestProbeAnswersOKWhenTheDriverIsReady(t *testing.T) {
	p := start(t, nil)
	if body := waitForAnswer(t, p.probe+"/healthz", http.StatusOK); body != "ok" {
		t.Errorf("body %q, want %q", body, "ok")
	}
	if n := len(p.backend.Calls(testdriver.MethodProbe)); n == 0 {
		t.Error("the driver saw no Probe")
	}
	// Only /healthz, as upstream's own port.
	if code, _, err := get(p.probe + "/metrics"); err != nil || code != http.StatusNotFound {
		t.Errorf("/metrics on the probe's port: %d %v, want 404", code, err)
	}
	p.stop(t)
}

func TestProbeFailsWhenTheDriversProbeFails(t *testing.T) {
	p := start(t, nil)
	waitForAnswer(t, p.probe+"/healthz", http.StatusOK)
	if err := p.backend.InjectFault(testdriver.Fault{Method: testdriver.MethodProbe, Code: codes.FailedPrecondition, Message: "disk pool offline"}); err != nil {
		t.Fatal(err)
	}
	code, body, err := get(p.probe + "/healthz")
	if err != nil || code != http.StatusInternalServerError || !strings.Contains(body, "disk pool offline") || !strings.Contains(body, "FailedPrecondition") {
		t.Errorf("a failing Probe: %d %q %v, want 500 with the driver's error", code, body, err)
	}
	p.backend.ClearFaults()
	waitForAnswer(t, p.probe+"/healthz", http.StatusOK)
	p.stop(t)
}

func TestProbeFailsWhenTheDriverIsNotReady(t *testing.T) {
	p := start(t, nil)
	waitForAnswer(t, p.probe+"/healthz", http.StatusOK)
	p.backend.SetProbeReady(false)
	code, body, err := get(p.probe + "/healthz")
	if err != nil || code != http.StatusInternalServerError || body != notReady {
		t.Errorf("a driver not ready: %d %q %v, want 500 %q", code, body, err, notReady)
	}
	p.stop(t)
}

// A driver that stops (its container restarted) fails the probe; served again on the same
// socket it passes again, and the probe never exited meanwhile.
func TestProbeFollowsTheDriverThroughARestart(t *testing.T) {
	p := start(t, []string{"--probe-timeout=500ms"})
	waitForAnswer(t, p.probe+"/healthz", http.StatusOK)
	p.driver.Stop()
	waitForAnswer(t, p.probe+"/healthz", http.StatusInternalServerError)
	select {
	case code := <-p.exited:
		t.Fatalf("the process exited with %d when the driver stopped", code)
	default:
	}
	var err error
	if p.driver, err = p.backend.Serve(p.socket); err != nil {
		t.Fatal(err)
	}
	waitForAnswer(t, p.probe+"/healthz", http.StatusOK)
	p.stop(t)
}

// Before the driver listens at all the probe answers 500 (upstream does not listen yet: the
// kubelet's probe fails either way), and 200 once it does.
func TestProbeFailsUntilTheDriverFirstAnswers(t *testing.T) {
	p := start(t, []string{"--probe-timeout=200ms"})
	p.driver.Stop()
	waitForAnswer(t, p.probe+"/healthz", http.StatusInternalServerError)
	var err error
	if p.driver, err = p.backend.Serve(p.socket); err != nil {
		t.Fatal(err)
	}
	waitForAnswer(t, p.probe+"/healthz", http.StatusOK)
	p.stop(t)
}

// impatient gives up on a probe after a moment: one the driver holds.
var impatient = &http.Client{Timeout: 200 * time.Millisecond}

// P1, P2 for the probe: after SIGTERM no new probe is taken, the one in the driver gets its
// answer, and the process exits 0; on its own port and on the diagnostics server.
func TestSIGTERMLetsTheProbeInFlightAnswer(t *testing.T) {
	t.Run("own port", func(t *testing.T) {
		p := start(t, []string{"--probe-timeout=1m"})
		testSIGTERM(t, p, p.probe, func() bool {
			_, _, err := getWith(impatient, p.probe+"/healthz")
			return err != nil && !errors.Is(err, context.DeadlineExceeded)
		})
	})
	t.Run("diagnostics server", func(t *testing.T) {
		diag := "http://127.0.0.1:" + freePort(t)
		p := start(t, []string{"--probe-timeout=1m", "--http-endpoint=" + strings.TrimPrefix(diag, "http://"), "--health-port=" + defaultHealthPort})
		testSIGTERM(t, p, diag, func() bool {
			code, _, err := getWith(impatient, diag+"/healthz")
			return err == nil && code == http.StatusServiceUnavailable
		})
	})
}

// testSIGTERM holds a probe of url in the driver, signals, waits until refused tells that
// new probes are turned away, then lets the driver answer.
func testSIGTERM(t *testing.T, p *process, url string, refused func() bool) {
	t.Helper()
	p.waitForProbe(t, url)
	release := p.backend.Hold(testdriver.MethodProbe)
	defer release()
	before := len(p.backend.Calls(testdriver.MethodProbe))
	type result struct {
		code int
		body string
		err  error
	}
	held := make(chan result, 1)
	go func() {
		code, body, err := get(url + "/healthz")
		held <- result{code, body, err}
	}()
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	defer cancel()
	if err := p.backend.WaitFor(ctx, func(calls []testdriver.Call) bool {
		return len(testdriver.CallsOf(calls, testdriver.MethodProbe)) > before
	}); err != nil {
		t.Fatal(err)
	}
	p.signals <- syscall.SIGTERM
	// New probes are turned away while the held one is still in the driver. A probe taken
	// before the signal reached the probe is held too: it gives up after a moment.
	waitFor(t, "new probes to be turned away", refused)
	select {
	case r := <-held:
		t.Fatalf("the probe in flight ended before the driver answered: %+v", r)
	default:
	}
	release()
	select {
	case r := <-held:
		if r.err != nil || r.code != http.StatusOK || r.body != "ok" {
			t.Errorf("the probe in flight at SIGTERM: %d %q %v, want 200 ok", r.code, r.body, r.err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("the probe in flight got no answer after the driver's")
	}
	if code := p.exitCode(t); code != lifecycle.ExitOK {
		t.Errorf("exit code %d, want %d", code, lifecycle.ExitOK)
	}
}

// A health port that cannot be listened on ends the process with 1 (upstream exits 0).
func TestAPortInUseExits1(t *testing.T) {
	l, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	p := start(t, []string{"--health-port=" + port})
	if code := p.exitCode(t); code != lifecycle.ExitError {
		t.Errorf("exit code %d, want %d", code, lifecycle.ExitError)
	}
}

// Alone with --http-endpoint, as upstream: the diagnostics server's /healthz is the driver's
// probe, and its metrics record each Probe under the driver's name.
func TestAloneWithHTTPEndpointTheDiagnosticsHealthzIsTheProbe(t *testing.T) {
	diag := "127.0.0.1:" + freePort(t)
	p := start(t, []string{"--http-endpoint=" + diag, "--metrics-path=/probe-metrics", "--health-port=" + defaultHealthPort})
	url := "http://" + diag
	p.waitForProbe(t, url)
	if err := p.backend.InjectFault(testdriver.Fault{Method: testdriver.MethodProbe, Code: codes.Unavailable, Message: "backend down"}); err != nil {
		t.Fatal(err)
	}
	if code, body, err := get(url + "/healthz"); err != nil || code != http.StatusInternalServerError || !strings.Contains(body, "backend down") {
		t.Errorf("diagnostics /healthz with a failing driver: %d %q %v, want the probe's 500", code, body, err)
	}
	p.backend.ClearFaults()
	want := []string{`method_name="/csi.v1.Identity/Probe"`, `driver_name="` + p.backend.DriverName() + `"`, `grpc_status_code="OK"`}
	waitFor(t, "csi_sidecar_operations_seconds of Probe on --metrics-path", func() bool {
		if code, _, err := get(url + "/healthz"); err != nil || code != http.StatusOK {
			return false
		}
		_, body, err := get(url + "/probe-metrics")
		if err != nil {
			return false
		}
		for line := range strings.SplitSeq(body, "\n") {
			if strings.HasPrefix(line, "csi_sidecar_operations_seconds_count{") && containsAll(line, want) {
				return true
			}
		}
		return false
	})
	p.stop(t)
}

func containsAll(s string, subs []string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// idle is a Server that does nothing until intake ends.
type idle struct{}

func (idle) Name() string              { return "idle" }
func (idle) AddFlags(_ *pflag.FlagSet) {}
func (idle) Serve(intake context.Context, _ *lifecycle.ServerEnv) error {
	<-intake.Done()
	return nil
}

// In combined mode --http-endpoint is the sidecar container's own diagnostics: its /healthz
// stays 200 while the driver's probe, on its own port, answers 500.
func TestCombinedTheProbeKeepsItsOwnPort(t *testing.T) {
	diag := "127.0.0.1:" + freePort(t)
	// A health port beside --http-endpoint is no conflict here.
	p := start(t, []string{"--http-endpoint=" + diag}, idle{})
	waitForAnswer(t, p.probe+"/healthz", http.StatusOK)
	if err := p.backend.InjectFault(testdriver.Fault{Method: testdriver.MethodProbe, Code: codes.Internal}); err != nil {
		t.Fatal(err)
	}
	if code, _, err := get(p.probe + "/healthz"); err != nil || code != http.StatusInternalServerError {
		t.Errorf("the probe with a failing driver: %d %v, want 500", code, err)
	}
	if code, body, err := get("http://" + diag + "/healthz"); err != nil || code != http.StatusOK || body != "ok" {
		t.Errorf("the diagnostics /healthz: %d %q %v, want 200 ok", code, body, err)
	}
	p.stop(t)
}

// Flags: what upstream refuses is refused with the flag's name and exit 2; what it accepts
// is accepted.
func TestFlags(t *testing.T) {
	for _, c := range []struct {
		args    []string
		wantErr string
	}{
		{[]string{"livenessprobe", "--health-port=9898", "--http-endpoint=:8080"}, "--health-port"},
		{[]string{"livenessprobe", "--metrics-address=:9809", "--http-endpoint=:8080"}, "--metrics-address"},
		// Upstream compares the string: its default, given, goes with --http-endpoint.
		{[]string{"livenessprobe", "--health-port=9808", "--http-endpoint=:8080"}, ""},
		{[]string{"livenessprobe", "--health-port=9898", "--metrics-address=:9809"}, ""},
		{[]string{"livenessprobe", "--probe-timeout=0"}, ""},
		{[]string{"livenessprobe", "--health-port=not-a-port"}, ""},
		{[]string{"livenessprobe", "--probe-timeout=soon"}, "--probe-timeout"},
		// In combined mode the port and the diagnostics are two servers.
		{[]string{"--controllers=livenessprobe,idle", "--livenessprobe-health-port=9898", "--http-endpoint=:8080"}, ""},
	} {
		root := lifecycle.NewRootCommand("csi-sidecars", "test", New(), idle{})
		err := lifecycle.ValidateArgs(root, c.args)
		if (c.wantErr == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.wantErr)) {
			t.Errorf("%v: %v, want %q", c.args, err, c.wantErr)
		}
	}
	var stderr bytes.Buffer
	root := lifecycle.NewRootCommand("csi-sidecars", "test", New())
	if code := lifecycle.Execute(t.Context(), root, []string{"livenessprobe", "--health-port=9898", "--http-endpoint=127.0.0.1:0"}, &stderr); code != lifecycle.ExitUsage {
		t.Errorf("exit code %d, want %d (%s)", code, lifecycle.ExitUsage, stderr.String())
	}
}
