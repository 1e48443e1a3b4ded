// Command image builds the csi-sidecars container image without a container engine
// (`make image`): it cross-compiles the static binary for each platform, puts it on an empty
// base as /csi-sidecars, and writes a multi-arch OCI image index, named by the version, to an
// OCI layout directory, optionally pushing it to a registry too.
//
// The image holds one file: no shell, no /etc/passwd, no CA bundle, as nothing in the binary
// reads them (the API server's CA comes from the service account or the kubeconfig). It runs
// as 65532:65532, distroless' nonroot, the user the manifests in deploy/ run it as. Every
// timestamp is the Unix epoch, so the same binaries make the same digests.
//
// It never touches the product's module: the binary is built by the go command from the
// repository's root, the way `make build` builds it plus -trimpath and stripped symbols.
package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

const (
	// binaryPath is where the image holds the binary; the image's entrypoint, on which the
	// manifests in deploy/ rely (they give only args).
	binaryPath = "/csi-sidecars"
	// user is distroless' nonroot user and group, as the manifests' securityContext names them.
	user = "65532:65532"
	// refName is the annotation of an OCI layout's index.json that names an entry.
	refName = "org.opencontainers.image.ref.name"
)

// epoch is every timestamp of the image: the layer's file and the config's creation time.
var epoch = time.Unix(0, 0).UTC()

// options is what one run builds and where it puts it.
type options struct {
	source    string        // the repository's root, holding ./cmd/csi-sidecars
	output    string        // the OCI layout directory, replaced whole
	version   string        // main.version of the binary; empty: git describe, as the Makefile
	platforms []v1.Platform // one image each in the index
	push      string        // a reference to push the index to; empty: none
}

func main() {
	o := options{}
	var platforms string
	flag.StringVar(&o.source, "source", "../..", "the repository's root")
	flag.StringVar(&o.output, "output", "../../_output/image", "the OCI layout directory to write (replaced)")
	flag.StringVar(&o.version, "version", "", "the binary's version (default: git describe --tags --always --dirty, else dev)")
	flag.StringVar(&platforms, "platforms", "linux/amd64,linux/arm64", "comma-separated os/arch of the images in the index")
	flag.StringVar(&o.push, "push", "", "also push the index to this reference (e.g. registry.example.com/csi-sidecars:v1), with the credentials of the default keychain (docker login)")
	flag.Parse()
	var err error
	if o.platforms, err = parsePlatforms(platforms); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

// run builds the index, writes it to the layout directory and pushes it if asked.
func run(ctx context.Context, o options) error {
	var ref name.Reference
	if o.push != "" {
		var err error
		// Before the build, which takes a while: a typo fails at once.
		if ref, err = name.ParseReference(o.push); err != nil {
			return fmt.Errorf("--push: %w", err)
		}
	}
	if o.version == "" {
		o.version = describe(ctx, o.source)
	}
	idx, err := build(ctx, o.source, o.version, o.platforms)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(o.output); err != nil {
		return fmt.Errorf("removing the old layout: %w", err)
	}
	// The layout's index.json names the image index by the version, as tools that copy one
	// image out of a layout (skopeo's oci:DIR:NAME) look it up.
	l, err := layout.Write(o.output, empty.Index)
	if err == nil {
		err = l.AppendIndex(idx, layout.WithAnnotations(map[string]string{refName: o.version}))
	}
	if err != nil {
		return fmt.Errorf("writing the OCI layout %s: %w", o.output, err)
	}
	digest, err := idx.Digest()
	if err != nil {
		return fmt.Errorf("digest of the index: %w", err)
	}
	fmt.Printf("csi-sidecars %s: %s in %s\n", o.version, digest, o.output)
	if ref == nil {
		return nil
	}
	if err := push(ctx, ref, idx); err != nil {
		return err
	}
	fmt.Printf("pushed %s@%s\n", ref.Context(), digest)
	return nil
}

// push writes idx and its images to ref with the default keychain's credentials.
func push(ctx context.Context, ref name.Reference, idx v1.ImageIndex) error {
	if err := remote.WriteIndex(ref, idx, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
		return fmt.Errorf("pushing to %s: %w", ref, err)
	}
	return nil
}

// build compiles the binary for each platform and returns the OCI index of their images.
func build(ctx context.Context, source, version string, platforms []v1.Platform) (v1.ImageIndex, error) {
	bins, err := os.MkdirTemp("", "csi-sidecars-image-")
	if err != nil {
		return nil, fmt.Errorf("a directory for the binaries: %w", err)
	}
	defer os.RemoveAll(bins)
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, p := range platforms {
		bin := filepath.Join(bins, p.OS+"_"+p.Architecture, "csi-sidecars")
		if err := compile(ctx, source, version, p, bin); err != nil {
			return nil, err
		}
		img, err := platformImage(bin, version, p)
		if err != nil {
			return nil, fmt.Errorf("the %s image: %w", p, err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add:        img,
			Descriptor: v1.Descriptor{Platform: &p},
		})
	}
	return idx, nil
}

// compile builds the static binary for p at out, as `make build` does with -trimpath and
// without symbol tables (as small as the image needs it; stack traces keep their names).
func compile(ctx context.Context, source, version string, p v1.Platform, out string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath",
		"-ldflags", "-s -w -X main.version="+version, "-o", out, "./cmd/csi-sidecars")
	cmd.Dir = source
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+p.OS, "GOARCH="+p.Architecture)
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build for %s: %w", p, err)
	}
	return nil
}

// platformImage is the image of the binary at bin for p: one layer, the config's user and
// entrypoint.
func platformImage(bin, version string, p v1.Platform) (v1.Image, error) {
	layer, err := binaryLayer(bin)
	if err != nil {
		return nil, err
	}
	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err = mutate.ConfigFile(img, &v1.ConfigFile{
		OS:           p.OS,
		Architecture: p.Architecture,
		// The one type the image spec knows; runtimes refuse others, and the empty one
		// ggcr leaves.
		RootFS: v1.RootFS{Type: "layers"},
		Config: v1.Config{
			User:       user,
			Entrypoint: []string{binaryPath},
			Labels:     map[string]string{"org.opencontainers.image.version": version},
		},
	})
	if err != nil {
		return nil, fmt.Errorf("setting the config: %w", err)
	}
	img, err = mutate.Append(img, mutate.Addendum{
		Layer:   layer,
		History: v1.History{Created: v1.Time{Time: epoch}, CreatedBy: "hack/image: " + binaryPath},
	})
	if err != nil {
		return nil, fmt.Errorf("adding the layer: %w", err)
	}
	return mutate.CreatedAt(img, v1.Time{Time: epoch})
}

// binaryLayer is a gzipped tar of the file at bin as binaryPath, owned by root and executable
// by anyone (the image runs it as a non-root user). It is compressed once, here: the digest,
// the layout and a push all read the same bytes.
func binaryLayer(bin string) (v1.Layer, error) {
	content, err := os.ReadFile(bin)
	if err != nil {
		return nil, fmt.Errorf("reading the binary: %w", err)
	}
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	hdr := &tar.Header{
		Typeflag: tar.TypeReg,
		Name:     strings.TrimPrefix(binaryPath, "/"),
		Mode:     0o755,
		Size:     int64(len(content)),
		ModTime:  epoch,
		Format:   tar.FormatPAX,
	}
	if err := tw.WriteHeader(hdr); err != nil {
		return nil, fmt.Errorf("writing the layer: %w", err)
	}
	if _, err := tw.Write(content); err != nil {
		return nil, fmt.Errorf("writing the layer: %w", err)
	}
	if err := errors.Join(tw.Close(), zw.Close()); err != nil {
		return nil, fmt.Errorf("writing the layer: %w", err)
	}
	gz := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(gz)), nil
	}, tarball.WithMediaType(types.OCILayer))
}

// describe is the version the Makefile gives `make build`: git describe, else "dev".
func describe(ctx context.Context, source string) string {
	out, err := exec.CommandContext(ctx, "git", "-C", source, "describe", "--tags", "--always", "--dirty").Output()
	if v := strings.TrimSpace(string(out)); err == nil && v != "" {
		return v
	}
	return "dev"
}

// parsePlatforms reads "linux/amd64,linux/arm64".
func parsePlatforms(s string) ([]v1.Platform, error) {
	var ps []v1.Platform
	for _, f := range strings.Split(s, ",") {
		p, err := v1.ParsePlatform(strings.TrimSpace(f))
		if err != nil {
			return nil, fmt.Errorf("--platforms %q: %w", f, err)
		}
		if p.OS == "" || p.Architecture == "" {
			return nil, fmt.Errorf("--platforms %q: want os/arch", f)
		}
		ps = append(ps, *p)
	}
	return ps, nil
}
