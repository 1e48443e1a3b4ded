package upstream

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// gitRepo makes a repository with one commit tagged tag in dir.
func gitRepo(t *testing.T, dir, tag string) {
	t.Helper()
	run := func(args ...string) {
		t.Helper()
		cmd := exec.Command("git", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@example.com", "GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@example.com")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	run("init", "-q")
	if err := os.WriteFile(filepath.Join(dir, "README"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	run("add", "README")
	run("commit", "-q", "-m", "x")
	run("tag", tag)
}

func release(t *testing.T, sidecar string) Release {
	t.Helper()
	for _, r := range Releases() {
		if r.Sidecar == sidecar {
			return r
		}
	}
	t.Fatalf("no release of %s", sidecar)
	return Release{}
}

func TestMirrorIsFoundInAnyFolderOfTheList(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("no git")
	}
	r := release(t, "attacher")
	empty, withClone := t.TempDir(), t.TempDir()
	gitRepo(t, filepath.Join(withClone, r.Repo), r.Tag)
	got, err := r.Mirror(empty + string(filepath.ListSeparator) + withClone)
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(withClone, r.Repo, ".git"); got != want {
		t.Errorf("mirror %s, want %s", got, want)
	}
}

func TestMirrorWithoutTheTagOrWithoutARepositorySaysWhereItLooked(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("no git")
	}
	r := release(t, "resizer")
	dir := t.TempDir()
	if _, err := r.Mirror(dir); err == nil || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), MirrorsEnv) {
		t.Errorf("no repository: %v, want an error naming %s and %s", err, dir, MirrorsEnv)
	}
	gitRepo(t, filepath.Join(dir, r.Repo), "v0.0.1")
	if _, err := r.Mirror(dir); err == nil || !strings.Contains(err.Error(), "no tag "+r.Tag) {
		t.Errorf("repository without the tag: %v, want an error naming the tag", err)
	}
}

func TestDefaultMirrorsFollowsTheEnvironment(t *testing.T) {
	t.Setenv(MirrorsEnv, "/a:/b")
	if got := DefaultMirrors(); got != "/a:/b" {
		t.Errorf("DefaultMirrors with $%s set: %q", MirrorsEnv, got)
	}
	t.Setenv(MirrorsEnv, "")
	if got := DefaultMirrors(); got != "/work/.mirror" {
		t.Errorf("DefaultMirrors: %q", got)
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
	if got := NamesOf(all); !strings.HasPrefix(got, Names()+", ") || !strings.HasSuffix(got, "external-snapshotter v8.7.0") {
		t.Errorf("NamesOf(AllReleases()) = %q", got)
	}
}

// The snapshotter's release is built, without a mirror that has its tag, from the module of
// the source tree that pins that tag and imports the binary's package.
func TestTheSnapshotterModulePinsItsTagAndImportsItsCommand(t *testing.T) {
	r := Snapshotter()
	dir, err := r.moduleDir()
	if err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	modPath, _, ok := strings.Cut(r.Package, "/cmd/")
	if !ok || !strings.Contains(string(gomod), "\t"+modPath+" "+r.Tag+"\n") && !strings.Contains(string(gomod), "require "+modPath+" "+r.Tag+"\n") {
		t.Errorf("%s/go.mod does not require %s %s", r.Module, modPath, r.Tag)
	}
	tools, err := os.ReadFile(filepath.Join(dir, "tools.go"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(tools), `_ "`+r.Package+`"`) {
		t.Errorf("%s/tools.go does not import %s: go.sum may lack its dependencies", r.Module, r.Package)
	}
}

func TestAReleaseNotBuiltSaysWhereItWouldBeBuiltFrom(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	got := CachedReleases(AllReleases())
	if len(got) != 4 {
		t.Fatalf("CachedReleases: %d releases", len(got))
	}
	for name, b := range got {
		if b.Err == nil || !strings.Contains(b.Err.Error(), "make bench") {
			t.Errorf("%s not built: %v", name, b.Err)
		}
	}
	if err := got["snapshotter"].Err; !strings.Contains(err.Error(), Snapshotter().Module) {
		t.Errorf("snapshotter not built: %v, want it to name %s", err, Snapshotter().Module)
	}
	if len(CachedAll()) != 3 {
		t.Errorf("CachedAll: %d releases, want the three of Releases", len(CachedAll()))
	}
}
