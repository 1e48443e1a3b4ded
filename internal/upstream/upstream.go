// Package upstream builds the upstream kubernetes-csi sidecar releases that benchmarks
// compare csi-sidecars with: external-attacher, external-provisioner and external-resizer,
// each at one tag (Releases).
//
// A release is built offline from a git mirror of its repository: the tag is extracted with
// git archive into a temporary folder and built with the dependencies it vendors
// (go build -mod=vendor) and the local Go toolchain. The binary is cached in
// $XDG_CACHE_HOME/csi-sidecars/upstream/<repo>-<tag>/<cmd> (default ~/.cache/...), beside
// the control plane's binaries, so only the first build takes minutes.
//
// Mirrors are looked for in a list of folders (the OS's path-list separator between them;
// DefaultMirrors): a bare mirror <dir>/kubernetes-csi+<repo>/repo (as the fetch tool leaves
// them), <dir>/<repo>.git or a clone <dir>/<repo>. Without one a build fails with an error
// saying where it looked, and a benchmark reports csi-sidecars only.
//
// The package holds no state: every function works from its arguments and the file system.
package upstream

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// MirrorsEnv names the environment variable that overrides DefaultMirrors' folder list.
const MirrorsEnv = "CSI_SIDECARS_UPSTREAM_MIRRORS"

// DefaultMirrors is $CSI_SIDECARS_UPSTREAM_MIRRORS, else /work/.mirror.
func DefaultMirrors() string {
	if dirs := os.Getenv(MirrorsEnv); dirs != "" {
		return dirs
	}
	return "/work/.mirror"
}

// Release is an upstream sidecar release.
type Release struct {
	Sidecar string // attacher, provisioner, resizer: csi-sidecars' subcommand it compares with
	Repo    string // the repository under github.com/kubernetes-csi
	Tag     string
	Cmd     string // the binary's package, ./cmd/<Cmd>, and the binary's name
}

// Releases are the releases csi-sidecars is compared with, in the order attacher,
// provisioner, resizer.
func Releases() []Release {
	return []Release{
		{Sidecar: "attacher", Repo: "external-attacher", Tag: "v4.12.0", Cmd: "csi-attacher"},
		{Sidecar: "provisioner", Repo: "external-provisioner", Tag: "v6.3.0", Cmd: "csi-provisioner"},
		{Sidecar: "resizer", Repo: "external-resizer", Tag: "v2.2.1", Cmd: "csi-resizer"},
	}
}

// Names lists the releases as "external-attacher v4.12.0, ...".
func Names() string {
	var names []string
	for _, r := range Releases() {
		names = append(names, r.String())
	}
	return strings.Join(names, ", ")
}

func (r Release) String() string { return r.Repo + " " + r.Tag }

// CacheDir is where built releases are kept between runs:
// $XDG_CACHE_HOME/csi-sidecars/upstream, default ~/.cache/csi-sidecars/upstream.
func CacheDir() (string, error) {
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("upstream: locating the cache folder: %w", err)
		}
		cache = filepath.Join(home, ".cache")
	}
	return filepath.Join(cache, "csi-sidecars", "upstream"), nil
}

// Mirror finds a git repository of r.Repo that has r.Tag in one of the folders of mirrors
// (a list separated by the OS's path-list separator).
func (r Release) Mirror(mirrors string) (string, error) {
	var tried []string
	for _, dir := range filepath.SplitList(mirrors) {
		for _, cand := range []string{
			filepath.Join(dir, "kubernetes-csi+"+r.Repo, "repo"),
			filepath.Join(dir, r.Repo+".git"),
			filepath.Join(dir, r.Repo, ".git"),
		} {
			if _, err := os.Stat(cand); err != nil {
				continue
			}
			tried = append(tried, cand)
			if exec.Command("git", "--git-dir="+cand, "rev-parse", "--verify", "--quiet", r.Tag+"^{commit}").Run() == nil {
				return cand, nil
			}
		}
	}
	if len(tried) > 0 {
		return "", fmt.Errorf("upstream: no tag %s in %s", r.Tag, strings.Join(tried, ", "))
	}
	return "", fmt.Errorf("upstream: no git mirror of %s in %q (set %s or the test's mirrors flag)", r.Repo, mirrors, MirrorsEnv)
}

// Cached returns the path of r's binary when it has been built before.
func (r Release) Cached() (string, bool) {
	root, err := CacheDir()
	if err != nil {
		return "", false
	}
	bin := filepath.Join(root, r.Repo+"-"+r.Tag, r.Cmd)
	fi, err := os.Stat(bin)
	return bin, err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// Build returns the path of r's binary, building it from a mirror in mirrors first when it
// is not cached. A build of one release takes minutes on 2 cores.
func (r Release) Build(mirrors string) (string, error) {
	if bin, ok := r.Cached(); ok {
		return bin, nil
	}
	root, err := CacheDir()
	if err != nil {
		return "", err
	}
	mirror, err := r.Mirror(mirrors)
	if err != nil {
		return "", err
	}
	src, err := os.MkdirTemp("", "csi-sidecars-upstream-")
	if err != nil {
		return "", fmt.Errorf("upstream: building %s: %w", r, err)
	}
	defer os.RemoveAll(src)
	if err := extract(mirror, r.Tag, src); err != nil {
		return "", fmt.Errorf("upstream: building %s: %w", r, err)
	}
	dir := filepath.Join(root, r.Repo+"-"+r.Tag)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("upstream: building %s: %w", r, err)
	}
	bin := filepath.Join(dir, r.Cmd)
	// Built under a name of its own and renamed: a build that is cut short, or another one
	// running at the same time, never leaves a partial binary under the cached name.
	tmp, err := os.CreateTemp(dir, r.Cmd+".tmp-")
	if err != nil {
		return "", fmt.Errorf("upstream: building %s: %w", r, err)
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	build := exec.Command("go", "build", "-mod=vendor", "-trimpath", "-ldflags=-X main.version="+r.Tag, "-o", tmp.Name(), "./cmd/"+r.Cmd)
	build.Dir = src
	build.Env = append(os.Environ(), "GOTOOLCHAIN=local", "GOFLAGS=-mod=vendor", "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("upstream: go build ./cmd/%s of %s: %w\n%s", r.Cmd, r, err, out)
	}
	if err := os.Rename(tmp.Name(), bin); err != nil {
		return "", fmt.Errorf("upstream: building %s: %w", r, err)
	}
	return bin, nil
}

// extract writes the tree of tag in the git repository gitDir into dir.
func extract(gitDir, tag, dir string) error {
	archive := exec.Command("git", "--git-dir="+gitDir, "archive", "--format=tar", tag)
	untar := exec.Command("tar", "-x", "-C", dir)
	var archiveErr, untarErr strings.Builder
	archive.Stderr, untar.Stderr = &archiveErr, &untarErr
	pipe, err := archive.StdoutPipe()
	if err != nil {
		return fmt.Errorf("git archive %s: %w", tag, err)
	}
	untar.Stdin = pipe
	if err := untar.Start(); err != nil {
		return fmt.Errorf("tar: %w", err)
	}
	if err := archive.Run(); err != nil {
		_ = untar.Wait()
		return fmt.Errorf("git archive %s of %s: %w: %s", tag, gitDir, err, archiveErr.String())
	}
	if err := untar.Wait(); err != nil {
		return fmt.Errorf("extracting %s: %w: %s", tag, err, untarErr.String())
	}
	return nil
}

// Binary is a built release, or why there is none.
type Binary struct {
	Release
	Path string
	Err  error
}

// CachedAll is every release as built before (BuildAll), by sidecar name; one not built has
// an Err saying so and how to build it. It builds nothing: a test run must not spend the
// minutes a first build takes.
func CachedAll() map[string]Binary {
	out := map[string]Binary{}
	for _, r := range Releases() {
		path, ok := r.Cached()
		var err error
		if !ok {
			err = fmt.Errorf("upstream: %s is not built; `make bench` builds it from a git mirror", r)
		}
		out[r.Sidecar] = Binary{Release: r, Path: path, Err: err}
	}
	return out
}

// BuildAll builds (or finds cached) every release, by sidecar name. A failure is kept in
// the Binary, not returned: a benchmark then measures csi-sidecars alone and says why. A
// line goes to log for each release that failed or took more than a second to build.
func BuildAll(mirrors string, log io.Writer) map[string]Binary {
	out := map[string]Binary{}
	for _, r := range Releases() {
		began := time.Now()
		path, err := r.Build(mirrors)
		out[r.Sidecar] = Binary{Release: r, Path: path, Err: err}
		switch {
		case err != nil:
			fmt.Fprintln(log, err) // it names the release and says why
		case time.Since(began) > time.Second:
			fmt.Fprintf(log, "upstream: built %s into %s in %v\n", r, path, time.Since(began).Round(time.Second))
		}
	}
	return out
}
