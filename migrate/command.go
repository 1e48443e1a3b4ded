package migrate

import (
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// NewCommand is `csi-sidecars migrate`: files (or stdin) in, converted manifests on
// stdout, the summary on stderr. Unreadable input and unknown flags exit 2.
func NewCommand(version string) *cobra.Command {
	opts := Options{Image: "csi-sidecars:" + version}
	var upstream []string
	cmd := &cobra.Command{
		Use:   "migrate [file...]",
		Short: "Convert manifests that run upstream's sidecar images to csi-sidecars, or back with --reverse",
		Long: `Reads Kubernetes manifests (files, or stdin: the output of helm template or kustomize build)
and writes them to stdout with each pod's upstream sidecar containers replaced by one
csi-sidecars container. A summary of what was merged, kept apart, and left for you goes to
stderr. It never talks to a cluster.

  csi-sidecars migrate < manifests.yaml > migrated.yaml
  csi-sidecars migrate --reverse --upstream-image attacher=registry.k8s.io/sig-storage/csi-attacher:v4.13.0 ... < migrated.yaml`,
		RunE: func(cmd *cobra.Command, files []string) error {
			opts.UpstreamImages = map[string]string{}
			for _, u := range upstream {
				name, image, ok := strings.Cut(u, "=")
				if !ok || image == "" || !slices.Contains(newCatalog().names, name) {
					return lifecycle.UsageError{Err: fmt.Errorf("--upstream-image %q: want <sidecar>=<image>, sidecar one of %s", u, strings.Join(newCatalog().names, ", "))}
				}
				opts.UpstreamImages[name] = image
			}
			var inputs [][]byte
			if len(files) == 0 {
				files = []string{"-"}
			}
			for _, f := range files {
				var b []byte
				var err error
				if f == "-" {
					b, err = io.ReadAll(cmd.InOrStdin())
				} else {
					b, err = os.ReadFile(f)
				}
				if err != nil {
					return lifecycle.UsageError{Err: fmt.Errorf("reading %s: %w", f, err)}
				}
				inputs = append(inputs, b)
			}
			res, err := Convert(opts, inputs...)
			if IsInputError(err) {
				return lifecycle.UsageError{Err: err}
			}
			if err != nil {
				return err
			}
			if _, err := cmd.OutOrStdout().Write(res.Output); err != nil {
				return err
			}
			for _, l := range res.Summary {
				fmt.Fprintln(cmd.ErrOrStderr(), l)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&opts.Image, "image", opts.Image, "csi-sidecars' image for the containers that replace upstream's")
	cmd.Flags().BoolVar(&opts.Reverse, "reverse", false, "turn csi-sidecars containers that migrate wrote back into upstream's containers")
	cmd.Flags().StringArrayVar(&upstream, "upstream-image", nil, "with --reverse: <sidecar>=<image> of upstream's sidecar, for example attacher=registry.k8s.io/sig-storage/csi-attacher:v4.13.0 (repeat per sidecar); by default the image recorded at migration")
	return cmd
}
