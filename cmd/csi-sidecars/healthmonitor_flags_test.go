package main

import (
	"os"
	"strings"
	"testing"
)

// upstreamHealthMonitorFlags are the flags cmd/csi-external-health-monitor-controller of
// external-health-monitor v0.18.0 defines itself, with their defaults. The Go module proxy
// does not serve that release, so the table is written here rather than downloaded.
var upstreamHealthMonitorFlags = map[string]string{
	"monitor-interval":         "1m0s",
	"resync":                   "10m0s",
	"timeout":                  "15s",
	"list-volumes-interval":    "5m0s",
	"volume-list-add-interval": "5m0s",
	"node-list-add-interval":   "5m0s",
	"worker-threads":           "10",
	"enable-node-watcher":      "false",
}

// Every flag of upstream's health monitor is a flag of `csi-sidecars health-monitor`, with
// upstream's default, and is named in the README with the release.
func TestEveryFlagOfUpstreamsHealthMonitorIsOursAndInTheREADME(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	root := newRoot()
	sub, _, err := root.Find([]string{"health-monitor"})
	if err != nil || sub == root {
		t.Fatalf("no subcommand health-monitor: %v", err)
	}
	for name, def := range upstreamHealthMonitorFlags {
		f := sub.Flags().Lookup(name)
		if f == nil {
			t.Errorf("external-health-monitor v0.18.0 has --%s; csi-sidecars health-monitor does not", name)
			continue
		}
		if f.DefValue != def {
			t.Errorf("--%s defaults to %s, upstream to %s", name, f.DefValue, def)
		}
		if !strings.Contains(string(readme), "`--"+name+"`") {
			t.Errorf("the README's flag tables do not name --%s", name)
		}
	}
	if !strings.Contains(string(readme), "external-health-monitor v0.18") {
		t.Error("the README does not name external-health-monitor v0.18")
	}
}
