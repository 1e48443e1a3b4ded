package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"
	"go.uber.org/automaxprocs/maxprocs"
	"k8s.io/klog/v2"
)

// FlagValidator is implemented by a sidecar whose own flags need checks beyond parsing.
// It runs before anything connects, so bad values fail fast (exit 2).
type FlagValidator interface {
	ValidateFlags() error
}

// NewRootCommand builds the csi-sidecars command: the shared flags as persistent flags, one
// subcommand per sidecar, and a version subcommand. The sidecars' feature gates join the
// shared --feature-gates flag.
func NewRootCommand(name, version string, sidecars ...Sidecar) *cobra.Command {
	opts := NewOptions()
	root := &cobra.Command{
		Use:           name,
		Short:         "Kubernetes CSI sidecars in one binary, with one lifecycle core",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	for _, s := range sidecars {
		if g, ok := s.(FeatureGated); ok {
			if err := opts.Gates.Add(g.Features()); err != nil {
				panic(fmt.Sprintf("feature gates of %s clash with another sidecar's: %v", s.Name(), err))
			}
		}
		root.AddCommand(sidecarCommand(opts, s))
	}
	opts.AddFlags(root.PersistentFlags())
	root.AddCommand(&cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run:   func(cmd *cobra.Command, _ []string) { fmt.Fprintln(cmd.OutOrStdout(), version) },
	})
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return UsageError{err} })
	return root
}

func sidecarCommand(opts *Options, s Sidecar) *cobra.Command {
	cmd := &cobra.Command{
		Use:   s.Name(),
		Short: "Run the " + s.Name() + " sidecar",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) > 0 {
				return UsageError{fmt.Errorf("unexpected arguments %q", args)}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := opts.Validate(); err != nil {
				return UsageError{err}
			}
			if err := opts.ApplyLogging(); err != nil {
				return UsageError{err}
			}
			if v, ok := s.(FlagValidator); ok {
				if err := v.ValidateFlags(); err != nil {
					return UsageError{err}
				}
			}
			ctx := klog.NewContext(cmd.Context(), klog.Background())
			if opts.Automaxprocs {
				if _, err := maxprocs.Set(maxprocs.Logger(klog.Infof)); err != nil {
					klog.FromContext(ctx).Error(err, "Cannot set GOMAXPROCS from the CPU quota")
				}
			}
			if code := Run(ctx, opts, s); code != ExitOK {
				return exitCode(code)
			}
			return nil
		},
	}
	s.AddFlags(cmd.Flags())
	return cmd
}

// exitCode carries a non-zero exit code out of cobra without an error message: the core
// has logged why already.
type exitCode int

func (c exitCode) Error() string { return fmt.Sprintf("exit code %d", int(c)) }

// Execute runs root with args (without the program name) and returns the process exit
// code: 2 for bad flags or usage, else what the core decided.
func Execute(ctx context.Context, root *cobra.Command, args []string, stderr io.Writer) int {
	root.SetArgs(NormalizeArgs(args))
	err := root.ExecuteContext(ctx)
	var code exitCode
	switch {
	case err == nil:
		return ExitOK
	case errors.As(err, &code):
		return int(code)
	case IsUsageError(err), strings.HasPrefix(err.Error(), "unknown command"):
		fmt.Fprintf(stderr, "Error: %v\nRun '%s --help' for usage.\n", err, root.Name())
		return ExitUsage
	default:
		fmt.Fprintf(stderr, "Error: %v\n", err)
		return ExitError
	}
}

// NormalizeArgs accepts upstream's single-dash spelling of long flags (-csi-address=/x,
// -leader-election), which Go's flag package allowed and existing manifests use: a single
// dash followed by a name of two or more letters becomes a double dash. One-letter
// shorthands (-v=5, -h) keep their meaning; nothing after "--" is touched.
func NormalizeArgs(args []string) []string {
	out := make([]string, 0, len(args))
	for i, a := range args {
		if a == "--" {
			return append(out, args[i:]...)
		}
		// A negative number ("-1" after --volume-name-uuid-length) is a value, not a flag.
		if len(a) > 2 && a[0] == '-' && a[1] != '-' && (a[1] < '0' || a[1] > '9') {
			name, _, _ := strings.Cut(a[1:], "=")
			if len(name) > 1 {
				a = "-" + a
			}
		}
		out = append(out, a)
	}
	return out
}
