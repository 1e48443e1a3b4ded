package main

import (
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// options is the parsed command line.
type options struct {
	endpoints   []string
	journalPath string
	config      testdriver.Config
}

// defaultCapabilities is the --capabilities default: every capability of
// testdriver.DefaultControllerCapabilities.
func defaultCapabilities() string {
	var names []string
	for _, c := range testdriver.DefaultControllerCapabilities() {
		names = append(names, c.String())
	}
	return strings.Join(names, ",")
}

// parseFlags parses args (without the program name) into options.
func parseFlags(fs *flag.FlagSet, args []string) (options, error) {
	var (
		o                 options
		endpoints         listFlag
		methodLatency     string
		capabilities      string
		nodes             string
		mutableParameters string
		controller        bool
		groupController   bool
	)
	fs.Var(&endpoints, "endpoint", "UNIX socket to serve CSI on, as a path or unix:// URL; repeat the flag or give a comma separated list. All sockets share one backend.")
	fs.StringVar(&o.config.DriverName, "drivername", testdriver.DefaultDriverName, "Driver name reported by GetPluginInfo.")
	fs.DurationVar(&o.config.Latency, "latency", 0, "Time each backend operation of a Controller RPC takes.")
	fs.StringVar(&methodLatency, "method-latency", "", "Per-method latency overrides, e.g. ControllerPublishVolume=2s,CreateVolume=500ms.")
	fs.StringVar(&capabilities, "capabilities", defaultCapabilities(), "Comma separated controller capabilities to advertise; empty for none.")
	fs.BoolVar(&controller, "controller-service", true, "Advertise the Controller service; false makes every Controller RPC Unimplemented.")
	fs.BoolVar(&groupController, "group-controller", true, "Serve the GroupController service (volume group snapshots) when --capabilities has CREATE_DELETE_SNAPSHOT.")
	fs.DurationVar(&o.config.SnapshotReadyAfter, "snapshot-ready-after", 0, "Report each snapshot ready_to_use=false until this long after it was cut.")
	fs.IntVar(&o.config.SnapshotReadyAfterPolls, "snapshot-ready-polls", 0, "Report each snapshot ready_to_use=false in this many answers describing it (its CreateSnapshot, then status polls).")
	fs.BoolVar(&o.config.Topology, "topology", false, "Advertise VOLUME_ACCESSIBILITY_CONSTRAINTS.")
	fs.StringVar(&o.config.NodeID, "node-id", testdriver.DefaultNodeID, "Node id reported by the Node service's NodeGetInfo.")
	fs.StringVar(&nodes, "nodes", "", "Comma separated node ids ControllerPublishVolume accepts besides --node-id; empty accepts any node id.")
	fs.Int64Var(&o.config.MaxVolumesPerNode, "max-volumes-per-node", 0, "Publications allowed per node; 0 for no limit.")
	fs.Int64Var(&o.config.TotalCapacity, "capacity", testdriver.DefaultTotalCapacity, "Size in bytes of the storage pool.")
	fs.StringVar(&mutableParameters, "mutable-parameters", strings.Join(testdriver.DefaultMutableParameters(), ","), "Comma separated mutable parameter keys ControllerModifyVolume accepts.")
	fs.BoolVar(&o.config.NodeExpansionRequired, "node-expansion-required", false, "ControllerExpandVolume answers node_expansion_required.")
	fs.BoolVar(&o.config.NodeExpansion, "node-expansion", false, "Advertise the Node service's EXPAND_VOLUME capability.")
	fs.StringVar(&o.journalPath, "journal", "", "File to append each finished call to, as one JSON line.")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if len(endpoints) == 0 {
		return o, fmt.Errorf("at least one --endpoint is required")
	}
	for _, e := range endpoints {
		o.endpoints = append(o.endpoints, socketPath(e))
	}

	var err error
	if o.config.MethodLatency, err = parseMethodLatency(methodLatency); err != nil {
		return o, fmt.Errorf("--method-latency: %w", err)
	}
	if o.config.ControllerCapabilities, err = testdriver.ParseControllerCapabilities(capabilities); err != nil {
		return o, fmt.Errorf("--capabilities: %w", err)
	}
	o.config.DisableControllerService = !controller
	o.config.DisableGroupController = !groupController
	if nodes != "" {
		o.config.Nodes = splitList(nodes)
	}
	o.config.MutableParameters = splitList(mutableParameters)
	return o, nil
}

// parseMethodLatency parses "Method=duration,Method2=duration".
func parseMethodLatency(s string) (map[string]time.Duration, error) {
	out := map[string]time.Duration{}
	for _, item := range splitList(s) {
		method, value, ok := strings.Cut(item, "=")
		if !ok || method == "" {
			return nil, fmt.Errorf("%q is not Method=duration", item)
		}
		d, err := time.ParseDuration(value)
		if err != nil {
			return nil, fmt.Errorf("latency of %s: %w", method, err)
		}
		out[strings.TrimSpace(method)] = d
	}
	return out, nil
}

// socketPath accepts a plain path or the unix:// and unix: forms sidecars
// use for --csi-address.
func socketPath(endpoint string) string {
	if p, ok := strings.CutPrefix(endpoint, "unix://"); ok {
		return p
	}
	if p, ok := strings.CutPrefix(endpoint, "unix:"); ok {
		return p
	}
	return endpoint
}

// splitList splits a comma separated list, dropping empty items.
func splitList(s string) []string {
	out := []string{}
	for _, item := range strings.Split(s, ",") {
		if item = strings.TrimSpace(item); item != "" {
			out = append(out, item)
		}
	}
	return out
}

// listFlag is a flag that may be repeated and takes comma separated lists.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Set(v string) error {
	*l = append(*l, splitList(v)...)
	return nil
}
