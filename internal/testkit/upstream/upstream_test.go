package upstream

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestRepoIsTheModulesNameWithoutItsMajorVersion(t *testing.T) {
	for module, want := range map[string]string{
		"github.com/kubernetes-csi/external-resizer/v2":     "external-resizer",
		"github.com/kubernetes-csi/external-attacher/v4":    "external-attacher",
		"github.com/kubernetes-csi/external-something":      "external-something",
		"github.com/kubernetes-csi/external-vsomething":     "external-vsomething",
		"github.com/kubernetes-csi/external-snapshotter/v8": "external-snapshotter",
	} {
		if got := (Release{Module: module}).Repo(); got != want {
			t.Errorf("Repo of %s: %q, want %q", module, got, want)
		}
	}
}

func TestCacheDirFollowsXDG(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", "/x")
	if got, err := CacheDir(); err != nil || got != "/x/csi-sidecars/upstream" {
		t.Errorf("CacheDir: %q, %v", got, err)
	}
}

func TestAllReleasesAreTheThreeAndTheSnapshotter(t *testing.T) {
	all := AllReleases()
	if len(all) != 4 || all[3] != Snapshotter() {
		t.Fatalf("AllReleases: %v", all)
	}
	for i, r := range Releases() {
		if all[i] != r {
			t.Errorf("AllReleases[%d] = %v, want %v", i, all[i], r)
		}
	}
	if got := NamesOf(all); got != "external-attacher v4.13.0, external-provisioner v6.4.0, external-resizer v2.3.0, external-snapshotter v8.7.0" {
		t.Errorf("NamesOf(AllReleases()) = %q", got)
	}
}

func TestAReleaseNotBuiltSaysWhereItWouldBeBuiltFrom(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	got := CachedReleases(AllReleases())
	if len(got) != 4 {
		t.Fatalf("CachedReleases: %d releases", len(got))
	}
	for name, b := range got {
		if b.Err == nil || !strings.Contains(b.Err.Error(), "make bench") || !strings.Contains(b.Err.Error(), b.Module+"@"+b.Tag) {
			t.Errorf("%s not built: %v", name, b.Err)
		}
	}
	if len(CachedAll()) != 3 {
		t.Errorf("CachedAll: %d releases, want the three of Releases", len(CachedAll()))
	}
}

func TestACachedBinaryIsUsedWithoutABuild(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	r := Release{Sidecar: "resizer", Module: "example.invalid/kubernetes-csi/external-resizer/v2", Tag: "v0.0.0", Cmd: "csi-resizer"}
	if _, err := r.Build(); err == nil || !strings.Contains(err.Error(), "go mod download") {
		t.Fatalf("build of a module no proxy has: %v, want the download's error", err)
	}
	root, _ := CacheDir()
	bin := filepath.Join(root, "external-resizer-v0.0.0", "csi-resizer")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got, err := r.Build(); err != nil || got != bin {
		t.Errorf("Build with the binary cached: %q, %v; want %s", got, err, bin)
	}
}

// The download is what a build starts from: the proxy (or the module cache) has the tag,
// and the module holds the command's package. Only with network access or a warm cache.
func TestEveryReleaseDownloadsWithItsCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("downloads modules")
	}
	for _, r := range AllReleases() {
		dir, err := r.Download()
		if err != nil {
			t.Errorf("%s: %v", r, err)
			continue
		}
		if goFiles, _ := filepath.Glob(filepath.Join(dir, "cmd", r.Cmd, "*.go")); len(goFiles) == 0 {
			t.Errorf("%s: no Go files in cmd/%s of %s", r, r.Cmd, dir)
		}
	}
}

// external-snapshotter's go.mod replaces its client module with the folder ./client, a
// nested module its zip does not hold: the build's copy requires that module from the
// proxy at the release's tag instead, and the command's packages then load.
func TestANestedModuleReplacedByAFolderComesFromTheProxyAtTheTag(t *testing.T) {
	if testing.Short() {
		t.Skip("downloads modules")
	}
	r := Snapshotter()
	mod, err := r.Download()
	if err != nil {
		t.Fatal(err)
	}
	src := t.TempDir()
	if err := copyTree(mod, src); err != nil {
		t.Fatal(err)
	}
	if err := r.replaceMissingDirs(src); err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile(filepath.Join(src, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	client := "github.com/kubernetes-csi/external-snapshotter/client/v8"
	if strings.Contains(string(gomod), client+" => ./client") || !strings.Contains(string(gomod), client+" "+r.Tag) {
		t.Errorf("go.mod still replaces %s by ./client, or does not require it at %s:\n%s", client, r.Tag, gomod)
	}
	list := exec.Command("go", "list", "./cmd/"+r.Cmd)
	list.Dir, list.Env = src, goEnv()
	if out, err := list.CombinedOutput(); err != nil {
		t.Errorf("go list ./cmd/%s: %v\n%s", r.Cmd, err, out)
	}
}
