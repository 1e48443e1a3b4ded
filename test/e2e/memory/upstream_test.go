package memory

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// upstreamRelease is an upstream sidecar release to compare with: built from its
// repository's tag, with the dependencies it vendors, so offline.
type upstreamRelease struct {
	sidecar string // attacher, provisioner, resizer
	repo    string // under github.com/kubernetes-csi
	tag     string
	cmd     string // ./cmd/<cmd>
}

var upstreamReleases = []upstreamRelease{
	{"attacher", "external-attacher", "v4.12.0", "csi-attacher"},
	{"provisioner", "external-provisioner", "v6.3.0", "csi-provisioner"},
	{"resizer", "external-resizer", "v2.2.1", "csi-resizer"},
}

func (u upstreamRelease) String() string { return u.repo + " " + u.tag }

// upstreamBinary is a built upstream binary, or why there is none.
type upstreamBinary struct {
	path string
	err  error
}

// cacheDir is where built upstream binaries are kept between runs:
// $XDG_CACHE_HOME/csi-sidecars/upstream (default ~/.cache/...), beside the control plane.
func cacheDir() (string, error) {
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", err
		}
		cache = filepath.Join(home, ".cache")
	}
	return filepath.Join(cache, "csi-sidecars", "upstream"), nil
}

// mirror finds a git repository of u.repo that has u.tag: a bare mirror
// <dir>/kubernetes-csi+<repo>/repo (as the fetch tool leaves them), <dir>/<repo>.git or a
// clone <dir>/<repo>, for each dir of the -memory.mirrors list.
func (u upstreamRelease) mirror() (string, error) {
	var tried []string
	for _, dir := range filepath.SplitList(*flagMirrors) {
		for _, cand := range []string{
			filepath.Join(dir, "kubernetes-csi+"+u.repo, "repo"),
			filepath.Join(dir, u.repo+".git"),
			filepath.Join(dir, u.repo, ".git"),
		} {
			if _, err := os.Stat(cand); err != nil {
				continue
			}
			tried = append(tried, cand)
			if exec.Command("git", "--git-dir="+cand, "rev-parse", "--verify", "--quiet", u.tag+"^{commit}").Run() == nil {
				return cand, nil
			}
		}
	}
	if len(tried) > 0 {
		return "", fmt.Errorf("no tag %s in %s", u.tag, strings.Join(tried, ", "))
	}
	return "", fmt.Errorf("no mirror of %s in %q (-memory.mirrors)", u.repo, *flagMirrors)
}

// build returns the cached binary of u, building it first when it is not cached: the tag
// is extracted with git archive into a temporary folder and built with its vendored
// modules and the local Go toolchain.
func (u upstreamRelease) build() (string, error) {
	root, err := cacheDir()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(root, u.repo+"-"+u.tag)
	bin := filepath.Join(dir, u.cmd)
	if fi, err := os.Stat(bin); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
		return bin, nil
	}
	mirror, err := u.mirror()
	if err != nil {
		return "", err
	}
	src, err := os.MkdirTemp("", "csi-sidecars-upstream-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(src)
	archive := exec.Command("git", "--git-dir="+mirror, "archive", "--format=tar", u.tag)
	untar := exec.Command("tar", "-x", "-C", src)
	var archiveErr, untarErr strings.Builder
	archive.Stderr, untar.Stderr = &archiveErr, &untarErr
	pipe, err := archive.StdoutPipe()
	if err != nil {
		return "", err
	}
	untar.Stdin = pipe
	if err := untar.Start(); err != nil {
		return "", err
	}
	if err := archive.Run(); err != nil {
		_ = untar.Wait()
		return "", fmt.Errorf("git archive %s: %v: %s", u.tag, err, archiveErr.String())
	}
	if err := untar.Wait(); err != nil {
		return "", fmt.Errorf("extracting %s: %v: %s", u.tag, err, untarErr.String())
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	tmp := bin + ".tmp"
	build := exec.Command("go", "build", "-mod=vendor", "-trimpath", "-ldflags=-X main.version="+u.tag, "-o", tmp, "./cmd/"+u.cmd)
	build.Dir = src
	build.Env = append(os.Environ(), "GOTOOLCHAIN=local", "GOFLAGS=-mod=vendor", "CGO_ENABLED=0")
	out, err := build.CombinedOutput()
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("go build ./cmd/%s: %v\n%s", u.cmd, err, out)
	}
	return bin, os.Rename(tmp, bin)
}

// upstreamBinaries are the upstream binaries by sidecar, built by TestMain before the
// tests start (so a first build does not count against the test timeout).
var upstreamBinaries map[string]upstreamBinary

// prepareUpstream builds (or finds cached) every upstream release; failures are kept,
// not fatal: the benchmark then reports ours only.
func prepareUpstream() {
	upstreamBinaries = map[string]upstreamBinary{}
	for _, u := range upstreamReleases {
		began := time.Now()
		path, err := u.build()
		upstreamBinaries[u.sidecar] = upstreamBinary{path: path, err: err}
		switch {
		case err != nil:
			fmt.Fprintf(os.Stderr, "memory: no upstream %s (%s): %v\n", u.sidecar, u, err)
		case time.Since(began) > time.Second:
			fmt.Fprintf(os.Stderr, "memory: built %s into %s in %v\n", u, path, time.Since(began).Round(time.Second))
		}
	}
}

var errNotPrepared = errors.New("upstream binaries are built only when benchmarks run (-bench) with -memory.upstream")
