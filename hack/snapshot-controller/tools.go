//go:build tools

// Package tools records the binaries built from external-snapshotter v8.7.0: the
// snapshot-controller the snapshotter's end-to-end tests run (hack/control-plane.sh), and
// csi-snapshotter, the upstream sidecar the memory benchmarks compare ours with
// (internal/upstream builds it into its cache).
package tools

import (
	_ "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter"
	_ "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller"
)
