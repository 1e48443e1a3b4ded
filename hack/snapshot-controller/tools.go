//go:build tools

// Package tools records the binary the snapshotter's end-to-end tests build:
// snapshot-controller of external-snapshotter v8.7.0.
package tools

import (
	_ "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller"
)
