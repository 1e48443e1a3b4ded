package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/internal/e2e"
)

// `make demo` in its short mode: every handover is clean and the summary is printed.
func TestDemoShort(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the demo starts a control plane and six sidecar processes")
	}
	bin, err := e2e.Binaries("../..")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(bin)
	var out bytes.Buffer
	_, err = run(context.Background(), options{short: true, bin: filepath.Join(bin, "csi-sidecars"), logDir: t.TempDir()}, &out)
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Summary", "provisioner-a -> provisioner-b", "attacher-a -> attacher-b", "resizer-a -> resizer-b"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

// BenchmarkFailover runs the demo (short mode) and reports, per sidecar, the leader's drain,
// the standby's first call after the leader's exit and its peak memory.
func BenchmarkFailover(b *testing.B) {
	bin, err := e2e.Binaries("../..")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(bin)
	for range b.N {
		var out bytes.Buffer
		results, err := run(context.Background(), options{short: true, bin: filepath.Join(bin, "csi-sidecars"), logDir: b.TempDir()}, &out)
		if err != nil {
			b.Fatalf("%v\n%s", err, out.String())
		}
		for _, h := range results {
			b.ReportMetric(h.drain.Seconds(), h.sidecar+"-drain-s")
			b.ReportMetric(h.firstCallAfterExit.Seconds(), h.sidecar+"-takeover-s")
			b.ReportMetric(float64(h.overlaps), h.sidecar+"-overlaps")
			b.ReportMetric(float64(h.standbyPeakRSS)/(1<<20), h.sidecar+"-peak-MiB")
		}
	}
}
