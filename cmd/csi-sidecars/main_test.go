package main

import (
	"debug/elf"
	"os/exec"
	"path/filepath"
	"testing"
)

// The image ships the binary on a base without a libc: it must be static, as built by the
// Dockerfile and `make build` (CGO_ENABLED=0).
func TestBinaryIsStatic(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "csi-sidecars")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	cmd.Env = append(cmd.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
			t.Errorf("binary is dynamically linked (program header %v)", p.Type)
		}
	}
}
