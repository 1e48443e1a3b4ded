package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/google/go-containerregistry/pkg/v1/validate"
	"sigs.k8s.io/yaml"
)

// repo is the repository's root, seen from this package.
const repo = "../.."

// machines is the ELF machine of each architecture the image is built for.
var machines = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}

// TestImage builds the image once, as `make image --push` does (both platforms, the version
// from git describe, written to an OCI layout and pushed to a registry on loopback), then reads
// it back and checks what a cluster relies on.
func TestImage(t *testing.T) {
	ctx := t.Context()
	reg := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer reg.Close()
	platforms, err := parsePlatforms("linux/amd64,linux/arm64")
	if err != nil {
		t.Fatal(err)
	}
	o := options{
		source:    repo,
		output:    filepath.Join(t.TempDir(), "image"),
		platforms: platforms,
		push:      strings.TrimPrefix(reg.URL, "http://") + "/csi-sidecars:test",
	}
	if err := run(ctx, o); err != nil {
		t.Fatal(err)
	}
	idx := layoutIndex(t, o.output)
	if err := validate.Index(idx); err != nil {
		t.Fatalf("the layout's index does not hold together: %v", err)
	}
	images := imagesByArch(t, idx)
	binaries := map[string]file{}
	for arch, img := range images {
		binaries[arch] = onlyFile(t, img)
	}

	t.Run("an image per platform holding a static binary of its machine", func(t *testing.T) {
		for _, p := range platforms {
			img, ok := images[p.Architecture]
			if !ok {
				t.Fatalf("no %s image in the index", p)
			}
			cfg, err := img.ConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			if cfg.OS != p.OS || cfg.Architecture != p.Architecture {
				t.Errorf("%s image's config says %s/%s", p, cfg.OS, cfg.Architecture)
			}
			if cfg.RootFS.Type != "layers" {
				t.Errorf("%s image's config has rootfs of type %q; runtimes take only \"layers\"", p, cfg.RootFS.Type)
			}
			f := elfBinary(t, binaries[p.Architecture].content)
			if f.Machine != machines[p.Architecture] {
				t.Errorf("%s binary is for %s, want %s", p, f.Machine, machines[p.Architecture])
			}
			for _, prog := range f.Progs {
				if prog.Type == elf.PT_INTERP || prog.Type == elf.PT_DYNAMIC {
					t.Errorf("%s binary is dynamically linked (program header %s): the image has no libc", p, prog.Type)
				}
			}
		}
	})

	t.Run("runs as non-root the binary the manifests expect as entrypoint", func(t *testing.T) {
		containers := manifestContainers(t)
		for arch, img := range images {
			cfg, err := img.ConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			uid, _, _ := strings.Cut(cfg.Config.User, ":")
			if uid == "" || uid == "0" || uid == "root" {
				t.Errorf("%s image runs as user %q, want non-root", arch, cfg.Config.User)
			}
			want := []string{"/" + binaries[arch].name}
			for _, c := range containers {
				argv := c.Command
				if len(argv) == 0 {
					argv = cfg.Config.Entrypoint
				}
				if !slices.Equal(argv, want) {
					t.Errorf("%s container %s runs %q before its args; the %s image holds its binary at %q",
						c.manifest, c.Name, argv, arch, want)
				}
			}
		}
	})

	t.Run("the binary prints the version git describe gave the build", func(t *testing.T) {
		native, ok := binaries[runtime.GOARCH]
		if !ok || runtime.GOOS != "linux" {
			t.Skipf("no image for this machine (%s/%s)", runtime.GOOS, runtime.GOARCH)
		}
		bin := filepath.Join(t.TempDir(), "csi-sidecars")
		if err := os.WriteFile(bin, native.content, 0o755); err != nil {
			t.Fatal(err)
		}
		out, err := exec.CommandContext(ctx, bin, "version").Output()
		if err != nil {
			t.Fatalf("csi-sidecars version: %v", err)
		}
		if got, want := strings.TrimSpace(string(out)), gitDescribe(t); got != want {
			t.Errorf("csi-sidecars version printed %q, want %q (git describe)", got, want)
		}
	})

	t.Run("--push writes the same index to the registry", func(t *testing.T) {
		ref, err := name.ParseReference(o.push)
		if err != nil {
			t.Fatal(err)
		}
		pushed, err := remote.Index(ref, remote.WithContext(ctx))
		if err != nil {
			t.Fatal(err)
		}
		got, err := pushed.Digest()
		if err != nil {
			t.Fatal(err)
		}
		want, err := idx.Digest()
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("the registry holds index %s, the layout %s", got, want)
		}
		for _, p := range platforms {
			if _, err := remote.Image(ref, remote.WithContext(ctx), remote.WithPlatform(p)); err != nil {
				t.Errorf("pulling the %s image: %v", p, err)
			}
		}
	})
}

// layoutIndex is the one image index the OCI layout at dir holds, named by the version git
// describe gives.
func layoutIndex(t *testing.T, dir string) v1.ImageIndex {
	t.Helper()
	top, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	m, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Manifests) != 1 || m.Manifests[0].MediaType != types.OCIImageIndex {
		t.Fatalf("the layout's index.json has %+v, want one image index", m.Manifests)
	}
	if got, want := m.Manifests[0].Annotations[refName], gitDescribe(t); got != want {
		t.Errorf("the layout names the image index %q, want %q (git describe)", got, want)
	}
	idx, err := top.ImageIndex(m.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	return idx
}

// gitDescribe is the version the Makefile gives the build.
func gitDescribe(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("git", "-C", repo, "describe", "--tags", "--always", "--dirty").Output()
	if err != nil {
		t.Fatalf("git describe: %v", err)
	}
	return strings.TrimSpace(string(out))
}

// imagesByArch are the images of idx by architecture; an index entry without a platform, or
// two for one, fails the test.
func imagesByArch(t *testing.T, idx v1.ImageIndex) map[string]v1.Image {
	t.Helper()
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	images := map[string]v1.Image{}
	for _, d := range m.Manifests {
		if d.Platform == nil {
			t.Fatalf("index entry %s has no platform", d.Digest)
		}
		if _, dup := images[d.Platform.Architecture]; dup {
			t.Fatalf("two index entries for %s", d.Platform)
		}
		img, err := idx.Image(d.Digest)
		if err != nil {
			t.Fatal(err)
		}
		images[d.Platform.Architecture] = img
	}
	return images
}

// file is a regular file of a layer.
type file struct {
	name    string
	content []byte
}

// onlyFile is the one regular file of img's one layer; anything else fails the test.
func onlyFile(t *testing.T, img v1.Image) file {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if len(layers) != 1 {
		t.Fatalf("%d layers, want 1", len(layers))
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var files []file
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if hdr.Typeflag != tar.TypeReg {
			t.Fatalf("layer holds %s of type %q, want only the binary", hdr.Name, hdr.Typeflag)
		}
		if hdr.Mode&0o001 == 0 {
			t.Errorf("%s has mode %o: a non-root user cannot run it", hdr.Name, hdr.Mode)
		}
		content, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, file{name: hdr.Name, content: content})
	}
	if len(files) != 1 {
		t.Fatalf("layer holds %d files, want the binary only", len(files))
	}
	return files[0]
}

// elfBinary reads content as an ELF executable.
func elfBinary(t *testing.T, content []byte) *elf.File {
	t.Helper()
	f, err := elf.NewFile(bytes.NewReader(content))
	if err != nil {
		t.Fatalf("the binary is not ELF: %v", err)
	}
	if f.Type != elf.ET_EXEC {
		t.Errorf("the binary is of ELF type %s, want %s", f.Type, elf.ET_EXEC)
	}
	return f
}

// container is what a manifest's container says about what it runs.
type container struct {
	manifest string
	Name     string   `json:"name"`
	Image    string   `json:"image"`
	Command  []string `json:"command"`
}

// manifestContainers are the containers of deploy/'s Deployments and DaemonSet that run the
// csi-sidecars image; none found fails the test.
func manifestContainers(t *testing.T) []container {
	t.Helper()
	var found []container
	for _, manifest := range []string{"deploy/example/deployment.yaml", "deploy/combined/deployment.yaml", "deploy/node/daemonset.yaml"} {
		raw, err := os.ReadFile(filepath.Join(repo, manifest))
		if err != nil {
			t.Fatal(err)
		}
		var d struct {
			Spec struct {
				Template struct {
					Spec struct {
						Containers []container `json:"containers"`
					} `json:"spec"`
				} `json:"template"`
			} `json:"spec"`
		}
		if err := yaml.Unmarshal(raw, &d); err != nil {
			t.Fatalf("%s: %v", manifest, err)
		}
		n := 0
		for _, c := range d.Spec.Template.Spec.Containers {
			if strings.HasPrefix(c.Image, "csi-sidecars:") {
				c.manifest = manifest
				found = append(found, c)
				n++
			}
		}
		if n == 0 {
			t.Fatalf("%s runs no csi-sidecars image", manifest)
		}
	}
	return found
}
