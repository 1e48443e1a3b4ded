// Package sidecars is the list of the sidecars csi-sidecars hosts: the binary registers
// them from here, and tests find a sidecar's Lease and flags here. Adding a sidecar is its
// package plus one line in All.
package sidecars

import (
	"github.com/csi-sidecars/csi-sidecars/attacher"
	"github.com/csi-sidecars/csi-sidecars/healthmonitor"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/livenessprobe"
	"github.com/csi-sidecars/csi-sidecars/provisioner"
	"github.com/csi-sidecars/csi-sidecars/registrar"
	"github.com/csi-sidecars/csi-sidecars/resizer"
	"github.com/csi-sidecars/csi-sidecars/snapshotter"
)

// All returns a new instance of every sidecar, in the order of the subcommands.
func All() []lifecycle.Hosted {
	return []lifecycle.Hosted{
		attacher.New(),
		resizer.New(),
		provisioner.New(),
		snapshotter.New(),
		healthmonitor.New(),
		registrar.New(),
		livenessprobe.New(),
	}
}

// Dir is the folder of the sidecar's package tree, from the module's root: its name, but
// for subcommands whose names are not a Go package's.
func Dir(name string) string {
	switch name {
	case registrar.Name:
		return "registrar"
	case healthmonitor.Name:
		return "healthmonitor"
	}
	return name
}

// Named returns a new instance of the sidecar called name, nil for none.
func Named(name string) lifecycle.Hosted {
	for _, s := range All() {
		if s.Name() == name {
			return s
		}
	}
	return nil
}
