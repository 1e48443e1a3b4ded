// Package livenessprobe runs the `csi-sidecars livenessprobe` binary against the project's
// test CSI driver, as the kubelet's liveness probe of a driver container would ask it. It
// needs no API server.
package livenessprobe

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

var binDir string

func TestMain(m *testing.M) { os.Exit(run(m)) }

func run(m *testing.M) int {
	flag.Parse()
	// -short runs no end-to-end test: building the binaries would be wasted.
	if !testing.Short() {
		dir, err := e2e.Binaries("../../..")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		binDir = dir
	}
	return m.Run()
}

// waitTimeout bounds every wait, far above what the conditions take.
const waitTimeout = 30 * time.Second

// status is the probe's answer to GET url, 0 when none came.
func status(url string) (int, string) {
	rsp, err := http.Get(url)
	if err != nil {
		return 0, ""
	}
	defer rsp.Body.Close()
	body, _ := io.ReadAll(rsp.Body)
	return rsp.StatusCode, string(body)
}

// waitForStatus polls url until it answers code.
func waitForStatus(t *testing.T, url string, code int, exited <-chan struct{}) string {
	t.Helper()
	deadline := time.After(waitTimeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		got, body := status(url)
		if got == code {
			return body
		}
		select {
		case <-tick.C:
		case <-exited:
			t.Fatalf("the process exited while waiting for %s to answer %d", url, code)
		case <-deadline:
			t.Fatalf("%s answered %d %q, want %d", url, got, body, code)
		}
	}
}

// The binary answers the kubelet's probe 200 while the driver answers, 500 once it is gone,
// and exits 0 on SIGTERM.
func TestTheBinaryProbesTheDriver(t *testing.T) {
	e2e.RequireBinaries(t, binDir)
	backend, err := testdriver.New(testdriver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	driver, err := backend.Serve(filepath.Join(t.TempDir(), "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(driver.Stop)
	port := e2e.FreePort(t)
	cmd := exec.Command(filepath.Join(binDir, "csi-sidecars"), "livenessprobe",
		"--csi-address="+driver.Socket(), "--health-port="+port, "--probe-timeout=1s", "-v=2")
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("--- log ---\n%s", stderr.String())
		}
	})

	url := "http://127.0.0.1:" + port + "/healthz"
	if body := waitForStatus(t, url, http.StatusOK, exited); body != "ok" {
		t.Errorf("body %q, want ok", body)
	}
	if len(backend.Calls(testdriver.MethodProbe)) == 0 {
		t.Error("the driver saw no Probe")
	}
	driver.Stop()
	waitForStatus(t, url, http.StatusInternalServerError, exited)

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	defer cancel()
	select {
	case <-exited:
	case <-ctx.Done():
		t.Fatal("the process did not exit after SIGTERM")
	}
	if code := e2e.ExitCode(waitErr); code != 0 {
		t.Errorf("exit code %d after SIGTERM, want 0", code)
	}
}
