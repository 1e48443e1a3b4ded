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
	err = run(context.Background(), options{short: true, bin: filepath.Join(bin, "csi-sidecars"), logDir: t.TempDir()}, &out)
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
