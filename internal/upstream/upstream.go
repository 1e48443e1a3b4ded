// Package upstream builds the upstream kubernetes-csi sidecar releases that benchmarks
// compare csi-sidecars with: external-attacher, external-provisioner and external-resizer
// (Releases), and external-snapshotter's csi-snapshotter (Snapshotter), each at one tag.
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
// A release with a Module (csi-snapshotter: no mirror here has its tag) is built, when no
// mirror has its tag, from a small Go module of csi-sidecars' source tree that requires the
// release (hack/snapshot-controller): go build of the binary's package there, with the
// sources of the Go module cache or proxy at the versions that module pins.
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
	Sidecar string // attacher, provisioner, resizer, snapshotter: csi-sidecars' subcommand it compares with
	Repo    string // the repository under github.com/kubernetes-csi
	Tag     string
	Cmd     string // the binary's package, ./cmd/<Cmd>, and the binary's name
	// Module, when set, is a folder of csi-sidecars' source tree (from its root) holding a
	// Go module that requires Package's module at Tag: the release is built there when no
	// mirror has the tag. Package is the binary's import path.
	Module  string
	Package string
}

// Releases are the releases csi-sidecars' attacher, provisioner and resizer are compared
// with, in that order. The snapshotter's is apart (Snapshotter): the benchmarks of the three
// run without the snapshot CRDs it needs.
func Releases() []Release {
	return []Release{
		{Sidecar: "attacher", Repo: "external-attacher", Tag: "v4.12.0", Cmd: "csi-attacher"},
		{Sidecar: "provisioner", Repo: "external-provisioner", Tag: "v6.3.0", Cmd: "csi-provisioner"},
		{Sidecar: "resizer", Repo: "external-resizer", Tag: "v2.2.1", Cmd: "csi-resizer"},
	}
}

// Snapshotter is the release csi-sidecars' snapshotter is compared with: csi-snapshotter of
// external-snapshotter v8.7.0. The mirror of external-snapshotter may lack the tag; then it
// is built from hack/snapshot-controller, the module that pins v8.7.0 for the
// snapshot-controller of the end-to-end tests (its tools.go imports both commands).
func Snapshotter() Release {
	return Release{Sidecar: "snapshotter", Repo: "external-snapshotter", Tag: "v8.7.0", Cmd: "csi-snapshotter",
		Module: "hack/snapshot-controller", Package: "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter"}
}

// AllReleases are Releases and Snapshotter: the four sidecars of csi-sidecars.
func AllReleases() []Release { return append(Releases(), Snapshotter()) }

// Names lists Releases as "external-attacher v4.12.0, ...".
func Names() string { return NamesOf(Releases()) }

// NamesOf lists releases as "external-attacher v4.12.0, ...".
func NamesOf(releases []Release) string {
	var names []string
	for _, r := range releases {
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

// Build returns the path of r's binary, building it first when it is not cached: from a
// mirror in mirrors that has r.Tag, else (r.Module set) from r.Module. A build of one release
// takes minutes on 2 cores.
func (r Release) Build(mirrors string) (string, error) {
	if bin, ok := r.Cached(); ok {
		return bin, nil
	}
	mirror, err := r.Mirror(mirrors)
	if err != nil {
		if r.Module == "" {
			return "", err
		}
		dir, modErr := r.moduleDir()
		if modErr != nil {
			return "", fmt.Errorf("%w; and %w", err, modErr)
		}
		return r.buildInto(func(out string) error { return r.buildModule(dir, out) })
	}
	return r.buildInto(func(out string) error { return r.buildMirror(mirror, out) })
}

// buildInto runs build with the path of a temporary file in r's cache folder and renames
// it to r's cached binary once build succeeded.
func (r Release) buildInto(build func(out string) error) (string, error) {
	root, err := CacheDir()
	if err != nil {
		return "", err
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
	if err := build(tmp.Name()); err != nil {
		return "", err
	}
	if err := os.Rename(tmp.Name(), bin); err != nil {
		return "", fmt.Errorf("upstream: building %s: %w", r, err)
	}
	return bin, nil
}

// buildMirror builds ./cmd/<Cmd> of r.Tag extracted from mirror, with its vendored
// dependencies, into out.
func (r Release) buildMirror(mirror, out string) error {
	src, err := os.MkdirTemp("", "csi-sidecars-upstream-")
	if err != nil {
		return fmt.Errorf("upstream: building %s: %w", r, err)
	}
	defer os.RemoveAll(src)
	if err := extract(mirror, r.Tag, src); err != nil {
		return fmt.Errorf("upstream: building %s: %w", r, err)
	}
	build := exec.Command("go", "build", "-mod=vendor", "-trimpath", "-ldflags=-X main.version="+r.Tag, "-o", out, "./cmd/"+r.Cmd)
	build.Dir = src
	build.Env = append(os.Environ(), "GOTOOLCHAIN=local", "GOFLAGS=-mod=vendor", "CGO_ENABLED=0")
	if output, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("upstream: go build ./cmd/%s of %s: %w\n%s", r.Cmd, r, err, output)
	}
	return nil
}

// buildModule builds r.Package in the module folder dir into out, after checking that the
// module pins the package's module at r.Tag. Its go.mod and go.sum are not changed
// (-mod=readonly); the sources come from the Go module cache, or the proxy the first time.
func (r Release) buildModule(dir, out string) error {
	env := append(os.Environ(), "GOTOOLCHAIN=local", "GOFLAGS=-mod=readonly", "CGO_ENABLED=0")
	list := exec.Command("go", "list", "-f", "{{.Module.Path}} {{.Module.Version}}", r.Package)
	list.Dir, list.Env = dir, env
	output, err := list.CombinedOutput()
	if err != nil {
		return fmt.Errorf("upstream: go list %s in %s: %w\n%s", r.Package, dir, err, output)
	}
	if mod := strings.Fields(string(output)); len(mod) != 2 || mod[1] != r.Tag {
		return fmt.Errorf("upstream: %s pins %s, not %s", dir, strings.TrimSpace(string(output)), r.Tag)
	}
	build := exec.Command("go", "build", "-trimpath", "-ldflags=-X main.version="+r.Tag, "-o", out, r.Package)
	build.Dir, build.Env = dir, env
	if output, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("upstream: go build %s of %s in %s: %w\n%s", r.Package, r, dir, err, output)
	}
	return nil
}

// moduleDir finds r.Module in csi-sidecars' source tree: in the working folder or the
// nearest of its parents that has it (tests run in their package's folder).
func (r Release) moduleDir() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("upstream: looking for %s: %w", r.Module, err)
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		cand := filepath.Join(dir, filepath.FromSlash(r.Module))
		if _, err := os.Stat(filepath.Join(cand, "go.mod")); err == nil {
			return cand, nil
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("upstream: no module %s in %s or a folder above it", r.Module, wd)
		}
	}
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

// CachedAll is CachedReleases(Releases()).
func CachedAll() map[string]Binary { return CachedReleases(Releases()) }

// CachedReleases is every one of releases as built before (BuildReleases), by sidecar name;
// one not built has an Err saying so and how to build it. It builds nothing: a test run must
// not spend the minutes a first build takes.
func CachedReleases(releases []Release) map[string]Binary {
	out := map[string]Binary{}
	for _, r := range releases {
		path, ok := r.Cached()
		var err error
		if !ok {
			from := "a git mirror"
			if r.Module != "" {
				from += " or " + r.Module
			}
			err = fmt.Errorf("upstream: %s is not built; `make bench` builds it from %s", r, from)
		}
		out[r.Sidecar] = Binary{Release: r, Path: path, Err: err}
	}
	return out
}

// BuildAll is BuildReleases(Releases(), mirrors, log).
func BuildAll(mirrors string, log io.Writer) map[string]Binary {
	return BuildReleases(Releases(), mirrors, log)
}

// BuildReleases builds (or finds cached) every one of releases, by sidecar name. A failure
// is kept in the Binary, not returned: a benchmark then measures csi-sidecars alone and says
// why. A line goes to log for each release that failed or took more than a second to build.
func BuildReleases(releases []Release, mirrors string, log io.Writer) map[string]Binary {
	out := map[string]Binary{}
	for _, r := range releases {
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
