// Package upstream builds the upstream kubernetes-csi sidecar releases that benchmarks
// compare csi-sidecars with: external-attacher, external-provisioner and external-resizer
// (Releases), and external-snapshotter's csi-snapshotter (Snapshotter), each at one tag.
//
// A release is built from the Go module proxy, like every other dependency: go mod download
// fetches the tagged module (checked against the checksum database), the module is copied
// into a writable temporary folder, and its command is built there with -mod=mod and the
// local Go toolchain. The copy is needed because the module cache is read-only and
// upstream's go.mod files carry version-only replace directives, which go install
// module@version refuses. The binary is cached in
// $XDG_CACHE_HOME/csi-sidecars/upstream/<repo>-<tag>/<cmd> (default ~/.cache/...), beside
// the control plane's binaries, so only the first build takes minutes.
//
// The package holds no state: every function works from its arguments and the file system.
package upstream

import (
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"time"
)

// Release is an upstream sidecar release.
type Release struct {
	Sidecar string // attacher, provisioner, resizer, snapshotter: csi-sidecars' subcommand it compares with
	Module  string // the Go module, github.com/kubernetes-csi/<repo>[/vN]
	Tag     string
	Cmd     string // the binary's package, ./cmd/<Cmd> of Module, and the binary's name
}

// Releases are the releases csi-sidecars' attacher, provisioner and resizer are compared
// with, in that order. The snapshotter's is apart (Snapshotter): the benchmarks of the three
// run without the snapshot CRDs it needs.
func Releases() []Release {
	return []Release{
		{Sidecar: "attacher", Module: "github.com/kubernetes-csi/external-attacher/v4", Tag: "v4.13.0", Cmd: "csi-attacher"},
		{Sidecar: "provisioner", Module: "github.com/kubernetes-csi/external-provisioner/v6", Tag: "v6.4.0", Cmd: "csi-provisioner"},
		{Sidecar: "resizer", Module: "github.com/kubernetes-csi/external-resizer/v2", Tag: "v2.3.0", Cmd: "csi-resizer"},
	}
}

// Snapshotter is the release csi-sidecars' snapshotter is compared with: csi-snapshotter of
// external-snapshotter v8.7.0.
func Snapshotter() Release {
	return Release{Sidecar: "snapshotter", Module: "github.com/kubernetes-csi/external-snapshotter/v8", Tag: "v8.7.0", Cmd: "csi-snapshotter"}
}

// AllReleases are Releases and Snapshotter: the four sidecars of csi-sidecars.
func AllReleases() []Release { return append(Releases(), Snapshotter()) }

// Names lists Releases as "external-attacher v4.13.0, ...".
func Names() string { return NamesOf(Releases()) }

// NamesOf lists releases as "external-attacher v4.13.0, ...".
func NamesOf(releases []Release) string {
	var names []string
	for _, r := range releases {
		names = append(names, r.String())
	}
	return strings.Join(names, ", ")
}

// Repo is the repository's name under github.com/kubernetes-csi: the last element of
// repoPath.
func (r Release) Repo() string { return path.Base(r.repoPath()) }

// repoPath is the repository's module path: Module without its major-version suffix.
func (r Release) repoPath() string {
	base := path.Base(r.Module)
	if len(base) > 1 && base[0] == 'v' && strings.Trim(base[1:], "0123456789") == "" {
		return path.Dir(r.Module)
	}
	return r.Module
}

func (r Release) String() string { return r.Repo() + " " + r.Tag }

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

// Cached returns the path of r's binary when it has been built before.
func (r Release) Cached() (string, bool) {
	root, err := CacheDir()
	if err != nil {
		return "", false
	}
	bin := filepath.Join(root, r.Repo()+"-"+r.Tag, r.Cmd)
	fi, err := os.Stat(bin)
	return bin, err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// Build returns the path of r's binary, building it first from the Go module proxy when it
// is not cached. A build of one release takes minutes on 2 cores.
func (r Release) Build() (string, error) {
	if bin, ok := r.Cached(); ok {
		return bin, nil
	}
	root, err := CacheDir()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(root, r.Repo()+"-"+r.Tag)
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
	if err := r.build(tmp.Name()); err != nil {
		return "", err
	}
	if err := os.Rename(tmp.Name(), bin); err != nil {
		return "", fmt.Errorf("upstream: building %s: %w", r, err)
	}
	return bin, nil
}

// goEnv is the environment of every go command run here: the local toolchain, module
// mode whatever the caller's GOFLAGS say, and a static binary.
func goEnv() []string {
	return append(os.Environ(), "GOTOOLCHAIN=local", "GO111MODULE=on", "GOFLAGS=-mod=mod", "CGO_ENABLED=0")
}

// Download fetches r's module at r.Tag into the Go module cache (from the proxy the first
// time) and returns its folder there, which is read-only.
func (r Release) Download() (string, error) {
	work, err := os.MkdirTemp("", "csi-sidecars-upstream-")
	if err != nil {
		return "", fmt.Errorf("upstream: downloading %s: %w", r, err)
	}
	defer os.RemoveAll(work)
	// Run outside any module, so that no go.mod of the caller's is read or changed.
	dl := exec.Command("go", "mod", "download", "-json", r.Module+"@"+r.Tag)
	dl.Dir, dl.Env = work, goEnv()
	out, err := dl.Output()
	var mod struct{ Dir, Error string }
	if jsonErr := json.Unmarshal(out, &mod); jsonErr != nil || mod.Error != "" || err != nil {
		detail := mod.Error
		if ee, ok := err.(*exec.ExitError); ok && detail == "" {
			detail = string(ee.Stderr)
		}
		return "", fmt.Errorf("upstream: go mod download %s@%s: %v %s", r.Module, r.Tag, err, strings.TrimSpace(detail))
	}
	return mod.Dir, nil
}

// build builds r's command into out: in a writable copy of the downloaded module, whose
// go.mod and go.sum go build -mod=mod may complete.
func (r Release) build(out string) error {
	mod, err := r.Download()
	if err != nil {
		return err
	}
	src, err := os.MkdirTemp("", "csi-sidecars-upstream-")
	if err != nil {
		return fmt.Errorf("upstream: building %s: %w", r, err)
	}
	defer os.RemoveAll(src)
	if err := copyTree(mod, src); err != nil {
		return fmt.Errorf("upstream: building %s: %w", r, err)
	}
	if err := r.replaceMissingDirs(src); err != nil {
		return err
	}
	build := exec.Command("go", "build", "-trimpath", "-ldflags=-X main.version="+r.Tag, "-o", out, "./cmd/"+r.Cmd)
	build.Dir, build.Env = src, goEnv()
	if output, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("upstream: go build ./cmd/%s of %s: %w\n%s", r.Cmd, r, err, output)
	}
	return nil
}

// replaceMissingDirs points the replace directives of the module in src whose target is a
// folder the module's zip does not hold (a nested module, such as external-snapshotter's
// ./client, has a zip of its own) at the module proxy instead: a module of the same
// repository at r.Tag, any other at the version go.mod requires.
func (r Release) replaceMissingDirs(src string) error {
	read := exec.Command("go", "mod", "edit", "-json")
	read.Dir, read.Env = src, goEnv()
	out, err := read.Output()
	if err != nil {
		return fmt.Errorf("upstream: reading the go.mod of %s: %w", r, err)
	}
	var mod struct {
		Replace []struct {
			Old, New struct{ Path, Version string }
		}
	}
	if err := json.Unmarshal(out, &mod); err != nil {
		return fmt.Errorf("upstream: reading the go.mod of %s: %w", r, err)
	}
	repo := r.repoPath()
	var args []string
	for _, rep := range mod.Replace {
		if rep.New.Version != "" {
			continue // a module of the proxy already
		}
		if _, err := os.Stat(filepath.Join(src, filepath.FromSlash(rep.New.Path))); err == nil {
			continue
		}
		args = append(args, "-dropreplace="+rep.Old.Path)
		if strings.HasPrefix(rep.Old.Path, repo+"/") {
			args = append(args, "-require="+rep.Old.Path+"@"+r.Tag)
		}
	}
	if len(args) == 0 {
		return nil
	}
	edit := exec.Command("go", append([]string{"mod", "edit"}, args...)...)
	edit.Dir, edit.Env = src, goEnv()
	if output, err := edit.CombinedOutput(); err != nil {
		return fmt.Errorf("upstream: go mod edit %v of %s: %w\n%s", args, r, err, output)
	}
	return nil
}

// copyTree copies the regular files and folders under from into to, writable by their owner.
func copyTree(from, to string) error {
	return filepath.WalkDir(from, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(from, p)
		if err != nil {
			return err
		}
		dst := filepath.Join(to, rel)
		switch {
		case d.IsDir():
			return os.MkdirAll(dst, 0o755)
		case !d.Type().IsRegular():
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(dst, data, 0o644)
	})
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
			err = fmt.Errorf("upstream: %s is not built; `make bench` builds it from the Go module proxy (%s@%s)", r, r.Module, r.Tag)
		}
		out[r.Sidecar] = Binary{Release: r, Path: path, Err: err}
	}
	return out
}

// BuildAll is BuildReleases(Releases(), log).
func BuildAll(log io.Writer) map[string]Binary {
	return BuildReleases(Releases(), log)
}

// BuildReleases builds (or finds cached) every one of releases, by sidecar name. A failure
// is kept in the Binary, not returned: a benchmark then measures csi-sidecars alone and says
// why. A line goes to log for each release that failed or took more than a second to build.
func BuildReleases(releases []Release, log io.Writer) map[string]Binary {
	out := map[string]Binary{}
	for _, r := range releases {
		began := time.Now()
		path, err := r.Build()
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
