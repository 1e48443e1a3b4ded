package migrate

import (
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/csi-sidecars/csi-sidecars/internal/sidecars"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// upstreamNames maps the last path element of an upstream image (without tag or digest),
// or the base name of its command, to the subcommand that replaces it. Mirrors that
// rename the images (EKS's external-*) are listed too.
var upstreamNames = map[string]string{
	"csi-attacher":                           "attacher",
	"external-attacher":                      "attacher",
	"csi-provisioner":                        "provisioner",
	"external-provisioner":                   "provisioner",
	"csi-resizer":                            "resizer",
	"external-resizer":                       "resizer",
	"csi-snapshotter":                        "snapshotter",
	"external-snapshotter":                   "snapshotter",
	"csi-node-driver-registrar":              "node-driver-registrar",
	"node-driver-registrar":                  "node-driver-registrar",
	"livenessprobe":                          "livenessprobe",
	"csi-external-health-monitor-controller": "health-monitor",
	"external-health-monitor-controller":     "health-monitor",
}

// catalog knows every flag of every subcommand, from the root command itself.
type catalog struct {
	names []string // the sidecars, in the order of the subcommands
	leads map[string]bool
	gates map[string][]string // the feature gates each sidecar reads
	// gateDefaults are those gates' defaults, by sidecar.
	gateDefaults map[string]map[string]bool
	shared       *pflag.FlagSet
	own          map[string]*pflag.FlagSet
}

// newRoot is the csi-sidecars command with every sidecar, for parsing args.
func newRoot() *cobra.Command {
	root := lifecycle.NewRootCommand("csi-sidecars", "migrate", sidecars.All()...)
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	return root
}

func newCatalog() *catalog {
	root := newRoot()
	c := &catalog{leads: map[string]bool{}, gates: map[string][]string{}, gateDefaults: map[string]map[string]bool{}, shared: root.PersistentFlags(), own: map[string]*pflag.FlagSet{}}
	for _, s := range sidecars.All() {
		name := s.Name()
		c.names = append(c.names, name)
		_, c.leads[name] = s.(lifecycle.Sidecar)
		if g, ok := s.(lifecycle.FeatureGated); ok {
			c.gateDefaults[name] = map[string]bool{}
			for f, spec := range g.Features() {
				c.gates[name] = append(c.gates[name], string(f))
				c.gateDefaults[name][string(f)] = spec.Default
			}
		}
		sub, _, err := root.Find([]string{name})
		if err != nil {
			panic(fmt.Sprintf("subcommand %s: %v", name, err))
		}
		c.own[name] = sub.LocalNonPersistentFlags()
	}
	return c
}

// sidecarOf tells which sidecar a container runs, "" for none of upstream's.
func sidecarOf(image string, command []string) string {
	if s := upstreamNames[imageBase(image)]; s != "" {
		return s
	}
	if len(command) > 0 {
		base := command[0][strings.LastIndex(command[0], "/")+1:]
		return upstreamNames[base]
	}
	return ""
}

// imageBase is an image reference's last path element without tag or digest.
func imageBase(image string) string {
	image, _, _ = strings.Cut(image, "@")
	base := image[strings.LastIndex(image, "/")+1:]
	base, _, _ = strings.Cut(base, ":")
	return base
}

// token is one flag of a container's args as written: --name=value, --name value, -v=5.
type token struct {
	name     string
	value    string
	hasValue bool
	shared   bool
}

// String is the token in the form csi-sidecars takes, with prefix before an own flag's name.
func (t token) spelled(prefix string) string {
	name := t.name
	if !t.shared && prefix != "" {
		name = prefix + "-" + name
	}
	if !t.hasValue {
		return "--" + name
	}
	return "--" + name + "=" + t.value
}

// flagFor finds the flag called name (or the one-letter shorthand) among the sidecar's own
// and the shared flags.
func (c *catalog) flagFor(sidecar, name string) (*pflag.Flag, bool) {
	if len(name) == 1 {
		if f := c.shared.ShorthandLookup(name); f != nil {
			return f, true
		}
		if f := c.own[sidecar].ShorthandLookup(name); f != nil {
			return f, false
		}
		return nil, false
	}
	if f := c.own[sidecar].Lookup(name); f != nil {
		return f, false
	}
	if f := c.shared.Lookup(name); f != nil {
		return f, true
	}
	return nil, false
}

// tokens splits a sidecar's args (either spelling) into flags, refusing what upstream's
// binary would: an unknown flag, a flag without its value, a positional argument.
func (c *catalog) tokens(sidecar string, args []string) ([]token, error) {
	args = lifecycle.NormalizeArgs(args)
	var out []token
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" || !strings.HasPrefix(a, "-") || a == "-" {
			return nil, fmt.Errorf("unexpected argument %q", a)
		}
		body := strings.TrimLeft(a, "-")
		name, value, hasValue := strings.Cut(body, "=")
		f, shared := c.flagFor(sidecar, name)
		if f == nil {
			return nil, fmt.Errorf("unknown flag: %s", a)
		}
		if !hasValue && f.NoOptDefVal == "" {
			if i+1 >= len(args) {
				return nil, fmt.Errorf("flag needs an argument: %s", a)
			}
			i++
			value, hasValue = args[i], true
		}
		out = append(out, token{name: f.Name, value: value, hasValue: hasValue, shared: shared})
	}
	return out, nil
}

// canonical parses a sidecar's args as its subcommand does and returns the value of each
// flag they set, as the flag prints it: "--leader-election" and "-leader-election=true"
// give the same string.
func canonical(sidecar string, args []string) (map[string]string, error) {
	root := newRoot()
	cmd, _, err := root.Find([]string{sidecar})
	if err != nil {
		return nil, err
	}
	cmd.Flags().SetOutput(io.Discard)
	if err := cmd.ParseFlags(lifecycle.NormalizeArgs(args)); err != nil {
		return nil, err
	}
	out := map[string]string{}
	cmd.Flags().Visit(func(f *pflag.Flag) { out[f.Name] = f.Value.String() })
	return out, nil
}

// ignoredBy are the shared flags a sidecar that does not lead accepts and does not use.
var ignoredBy = []string{"leader-election", "leader-election-namespace", "leader-election-identity",
	"leader-election-lease-duration", "leader-election-renew-deadline", "leader-election-retry-period",
	"leader-election-labels", "kubeconfig", "master", "kube-api-qps", "kube-api-burst"}

// uses tells whether the sidecar's behaviour depends on the shared flag.
func (c *catalog) uses(sidecar, flag string) bool {
	return c.leads[sidecar] || !slices.Contains(ignoredBy, flag)
}
