//go:build tools

// Package tools records the snapshot-controller of external-snapshotter v8.7.0 that the
// snapshotter's end-to-end tests run (hack/control-plane.sh builds it into the cache).
package tools

import (
	_ "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller"
)
