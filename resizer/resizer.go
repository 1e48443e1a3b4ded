// Package resizer is the csi-sidecars resizer, the drop-in for upstream external-resizer, hosted by
// the lifecycle core. It never handles signals, Leases or process exit.
//
// Not implemented yet: the subcommand exists so the binary's shape is final; it refuses
// to start with a clear error until its own issue lands.
package resizer

import (
	"context"
	"errors"

	"github.com/spf13/pflag"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Sidecar is the resizer.
type Sidecar struct{}

// New returns the resizer sidecar.
func New() *Sidecar { return &Sidecar{} }

var _ lifecycle.Sidecar = &Sidecar{}

// Name implements lifecycle.Sidecar.
func (*Sidecar) Name() string { return "resizer" }

// AddFlags implements lifecycle.Sidecar.
func (*Sidecar) AddFlags(*pflag.FlagSet) {}

// LeaseName implements lifecycle.Sidecar with upstream's Lease name.
func (*Sidecar) LeaseName(driver string) string { return "external-resizer-" + driver }

// ValidateFlags implements lifecycle.FlagValidator: it refuses to start.
func (*Sidecar) ValidateFlags() error {
	return errors.New("csi-sidecars resizer is not implemented yet")
}

// Setup implements lifecycle.Sidecar.
func (*Sidecar) Setup(*lifecycle.Env) error { return errors.New("not implemented yet") }

// Run implements lifecycle.Sidecar.
func (*Sidecar) Run(context.Context, *lifecycle.Env) error { return errors.New("not implemented yet") }
