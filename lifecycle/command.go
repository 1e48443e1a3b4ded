package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/automaxprocs/maxprocs"
	"k8s.io/klog/v2"
)

// FlagValidator is implemented by a sidecar whose own flags need checks beyond parsing.
// It runs before anything connects, so bad values fail fast (exit 2). It refuses only what
// upstream refuses too; a value upstream accepts but that is unlikely to be meant gets
// WarnFlag instead.
type FlagValidator interface {
	ValidateFlags() error
}

// WarnFlag logs that --flag=value is accepted, as upstream does, and what it will do.
func WarnFlag(flag string, value any, effect string) {
	klog.Background().Info("Warning: unusual flag value, accepted as upstream does", "flag", "--"+flag, "value", fmt.Sprint(value), "effect", effect)
}

// NewRootCommand builds the csi-sidecars command: the shared flags as persistent flags, one
// subcommand per sidecar, a version subcommand, and combined mode on the root:
// `--controllers=attacher,resizer` runs several sidecars in one process (KEP-4958's form),
// each sidecar's own flags then spelled with its name as prefix (--attacher-worker-threads).
// The sidecars' feature gates join the shared --feature-gates flag.
func NewRootCommand(name, version string, sidecars ...Hosted) *cobra.Command {
	opts := NewOptions()
	var controllers []string
	root := &cobra.Command{
		Use:           name,
		Short:         "Kubernetes CSI sidecars in one binary, with one lifecycle core",
		Long:          "Run one sidecar with its subcommand, or several in one process with --controllers.",
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          noArgs,
	}
	for _, s := range sidecars {
		if g, ok := s.(FeatureGated); ok {
			if err := opts.Gates.Add(g.Features()); err != nil {
				panic(fmt.Sprintf("feature gates of %s clash with another sidecar's: %v", s.Name(), err))
			}
		}
		sub := sidecarCommand(opts, s, version)
		root.AddCommand(sub)
		// The same flag values, prefixed, for combined mode.
		sub.Flags().VisitAll(func(f *pflag.Flag) {
			root.Flags().AddFlag(&pflag.Flag{Name: s.Name() + "-" + f.Name, Usage: f.Usage + " (" + s.Name() + ")",
				Value: f.Value, DefValue: f.DefValue, NoOptDefVal: f.NoOptDefVal})
		})
	}
	opts.AddFlags(root.PersistentFlags())
	root.Flags().StringSliceVar(&controllers, "controllers", nil, "Run these sidecars in one process, for example attacher,provisioner,resizer: one CSI connection, one HTTP server, shared informers, a Lease per sidecar. Their own flags take the sidecar's name as prefix (--attacher-worker-threads).")
	selected := func() ([]Hosted, error) {
		var out []Hosted
		for _, c := range controllers {
			i := slices.IndexFunc(sidecars, func(s Hosted) bool { return s.Name() == strings.TrimSpace(c) })
			if i < 0 {
				return nil, fmt.Errorf("--controllers: unknown sidecar %q", c)
			}
			if !slices.Contains(out, sidecars[i]) {
				out = append(out, sidecars[i])
			}
		}
		return out, nil
	}
	root.PreRunE = func(cmd *cobra.Command, _ []string) error {
		if opts.ShowVersion || len(controllers) == 0 {
			return nil
		}
		run, err := selected()
		if err != nil {
			return UsageError{err}
		}
		return validate(cmd, opts, run)
	}
	root.RunE = func(cmd *cobra.Command, _ []string) error {
		switch {
		case opts.ShowVersion:
			// `csi-sidecars --version`, beside the subcommands' --version, as upstream's binaries.
			fmt.Fprintln(cmd.OutOrStdout(), name, version)
			return nil
		case len(controllers) == 0:
			return cmd.Help()
		}
		run, err := selected()
		if err != nil {
			return UsageError{err}
		}
		return runSidecars(cmd, opts, run)
	}
	root.AddCommand(&cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run:   func(cmd *cobra.Command, _ []string) { fmt.Fprintln(cmd.OutOrStdout(), version) },
	})
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return UsageError{err} })
	return root
}

func noArgs(_ *cobra.Command, args []string) error {
	if len(args) > 0 {
		return UsageError{fmt.Errorf("unexpected arguments %q", args)}
	}
	return nil
}

func sidecarCommand(opts *Options, s Hosted, version string) *cobra.Command {
	cmd := &cobra.Command{
		Use:   s.Name(),
		Short: "Run the " + s.Name() + " sidecar",
		Args:  noArgs,
		// Everything that can refuse the flags runs here, before anything connects.
		PreRunE: func(cmd *cobra.Command, _ []string) error {
			if opts.ShowVersion {
				return nil
			}
			return validate(cmd, opts, []Hosted{s})
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			if opts.ShowVersion {
				fmt.Fprintln(cmd.OutOrStdout(), cmd.Root().Name(), version)
				return nil
			}
			return runSidecars(cmd, opts, []Hosted{s})
		},
	}
	s.AddFlags(cmd.Flags())
	return cmd
}

// validate runs every check that can refuse the flags of these sidecars: the shared ones,
// then each sidecar's own (named after it when there are several).
func validate(cmd *cobra.Command, opts *Options, sidecars []Hosted) error {
	if err := opts.Validate(); err != nil {
		return UsageError{err}
	}
	// klog is process-wide: a dry run (ValidateArgs) checks it but must not apply it.
	if cmd.Context() == nil || cmd.Context().Value(dryRun{}) == nil {
		if err := opts.ApplyLogging(); err != nil {
			return UsageError{err}
		}
	}
	if opts.LeaderElection && !slices.ContainsFunc(sidecars, leads) {
		WarnFlag("leader-election", true, "ignored: none of these sidecars leads, each runs on every replica")
	}
	for _, s := range sidecars {
		var err error
		if v, ok := s.(FlagValidator); ok {
			err = v.ValidateFlags()
		}
		if v, ok := s.(SharedFlagValidator); ok && err == nil {
			err = v.ValidateSharedFlags(opts)
		}
		if err != nil {
			if len(sidecars) > 1 {
				err = fmt.Errorf("%s: %w", s.Name(), err)
			}
			return UsageError{err}
		}
	}
	return nil
}

// runSidecars runs the sidecars in this process until it should end.
func runSidecars(cmd *cobra.Command, opts *Options, sidecars []Hosted) error {
	ctx := klog.NewContext(cmd.Context(), klog.Background())
	if opts.Automaxprocs {
		if _, err := maxprocs.Set(maxprocs.Logger(klog.Infof)); err != nil {
			klog.FromContext(ctx).Error(err, "Cannot set GOMAXPROCS from the CPU quota")
		}
	}
	if !opts.EnablePprof {
		// Nobody can read a heap profile: the runtime need not sample one (the samples'
		// records cost about 2 MiB after the caches filled).
		runtime.MemProfileRate = 0
	}
	if code := Run(ctx, opts, sidecars...); code != ExitOK {
		return exitCode(code)
	}
	return nil
}

// ValidateArgs parses args (without the program name) for root's subcommand and runs every
// check that could refuse them, without starting anything: what a manifest's args must pass.
func ValidateArgs(root *cobra.Command, args []string) error {
	args = NormalizeArgs(args)
	cmd, rest, err := root.Find(args)
	if err != nil {
		return err
	}
	if err := cmd.ParseFlags(rest); err != nil {
		return err
	}
	if cmd.Args != nil {
		if err := cmd.Args(cmd, cmd.Flags().Args()); err != nil {
			return err
		}
	}
	if cmd.PreRunE == nil {
		return fmt.Errorf("%q runs no sidecar", cmd.Name())
	}
	cmd.SetContext(context.WithValue(context.Background(), dryRun{}, true))
	return cmd.PreRunE(cmd, cmd.Flags().Args())
}

// dryRun marks the context of a ValidateArgs run.
type dryRun struct{}

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

// SharedFlagValidator is implemented by a sidecar whose own flags conflict with some values
// of the shared ones (for example a node deployment, which runs without leader election).
// It runs with FlagValidator, before anything connects.
type SharedFlagValidator interface {
	ValidateSharedFlags(shared *Options) error
}

// leads tells whether s is a sidecar that leads (with a Lease under --leader-election).
func leads(s Hosted) bool {
	_, ok := s.(Sidecar)
	return ok
}
