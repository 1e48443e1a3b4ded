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
