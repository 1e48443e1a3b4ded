// Package finalizer is the finalizer the attacher puts on VolumeAttachments and
// PersistentVolumes, named as upstream's external-attacher names it (P9), and the edits of
// finalizer lists the attacher makes. It is pure: no API, no state.
package finalizer

import (
	"slices"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// prefix is upstream's: the finalizer of driver d is external-attacher/<d, sanitised>.
const prefix = "external-attacher/"

// Name is the finalizer the attacher of driver puts on VolumeAttachments and PVs.
func Name(driver string) string {
	return prefix + lifecycle.SanitizeName(driver)
}

// Has tells whether finalizers include name.
func Has(finalizers []string, name string) bool { return slices.Contains(finalizers, name) }

// Without returns finalizers without name (nil when none is left).
func Without(finalizers []string, name string) []string {
	var out []string
	for _, f := range finalizers {
		if f != name {
			out = append(out, f)
		}
	}
	return out
}
