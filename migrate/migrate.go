// Package migrate converts Kubernetes manifests that run upstream's CSI sidecar images
// (external-attacher, external-provisioner, external-resizer, csi-snapshotter,
// node-driver-registrar, livenessprobe, external-health-monitor-controller) into manifests
// that run csi-sidecars, and back: `csi-sidecars migrate` and `csi-sidecars migrate
// --reverse`.
//
// In every Deployment, StatefulSet and DaemonSet pod template, the upstream sidecar
// containers become one csi-sidecars container in combined mode (--controllers), with their
// flags as csi-sidecars spells them, their env, mounts, resources, security context, probes
// and diagnostics ports merged; Services, ServiceMonitors and PodMonitors of the input that
// pointed at a port that is gone are pointed at the one diagnostics endpoint; RBAC of the
// input is checked, not changed. What the reverse needs is recorded in an annotation of the
// pod template. Every other document is written back as it was read.
package migrate

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Options of a conversion.
type Options struct {
	// Image is csi-sidecars' image, for the containers that replace upstream's.
	Image string
	// Reverse turns csi-sidecars containers that migrate wrote back into upstream's.
	Reverse bool
	// UpstreamImages are the images of upstream's sidecars for Reverse, by subcommand name
	// (attacher, provisioner, node-driver-registrar...).
	UpstreamImages map[string]string
}

// InputError is input that cannot be converted: unreadable YAML, a container with a flag
// its sidecar does not have. The command exits 2 with it.
type InputError struct{ Err error }

func (e InputError) Error() string { return e.Err.Error() }
func (e InputError) Unwrap() error { return e.Err }

// IsInputError tells whether err is an InputError.
func IsInputError(err error) bool {
	var ie InputError
	return errors.As(err, &ie)
}

// Result of a conversion.
type Result struct {
	// Output is the converted stream of documents.
	Output []byte
	// Summary is what was done, kept apart and left for the user, one line each.
	Summary []string
}

// Convert converts the documents of inputs (each a stream of YAML documents), in order.
func Convert(opts Options, inputs ...[]byte) (*Result, error) {
	var docs []*document
	for i, in := range inputs {
		for j, d := range splitDocuments(in) {
			if err := d.parse(); err != nil {
				return nil, InputError{fmt.Errorf("input %d, document %d: %w", i+1, j+1, err)}
			}
			docs = append(docs, d)
		}
	}
	c := newCatalog()
	r := &run{opts: opts, cat: c, docs: docs}
	var err error
	if opts.Reverse {
		err = r.reverse()
	} else {
		err = r.forward()
	}
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	for _, d := range docs {
		if err := d.render(&out); err != nil {
			return nil, err
		}
	}
	return &Result{Output: out.Bytes(), Summary: r.summary}, nil
}

// run is one conversion.
type run struct {
	opts    Options
	cat     *catalog
	docs    []*document
	summary []string
}

func (r *run) say(format string, args ...any) {
	r.summary = append(r.summary, fmt.Sprintf(format, args...))
}

// workloads are the kinds whose pod template is converted.
var workloads = []string{"Deployment", "StatefulSet", "DaemonSet"}

func isWorkload(d *document) bool {
	return d.node != nil && slices.Contains(workloads, d.kind) && strings.HasPrefix(d.apiVersion, "apps/")
}

// annotation is the pod template annotation that records what --reverse needs.
const annotation = "csi-sidecars.io/upstream-containers"
