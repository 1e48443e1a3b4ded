package main

import (
	"flag"
	"io"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func parse(t *testing.T, args ...string) (options, error) {
	t.Helper()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return parseFlags(fs, args)
}

func TestParseFlags(t *testing.T) {
	o, err := parse(t,
		"--endpoint", "unix:///tmp/a.sock,/tmp/b.sock", "--endpoint=unix:/tmp/c.sock",
		"--method-latency", "ControllerPublishVolume=2s, CreateVolume=5ms",
		"--capabilities", "CREATE_DELETE_VOLUME,list_volumes",
		"--nodes", "n1,n2",
	)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"/tmp/a.sock", "/tmp/b.sock", "/tmp/c.sock"}; !slices.Equal(o.endpoints, want) {
		t.Errorf("endpoints %v, want %v", o.endpoints, want)
	}
	if got := o.config.MethodLatency; got[testdriver.MethodControllerPublishVolume] != 2*time.Second || got[testdriver.MethodCreateVolume] != 5*time.Millisecond {
		t.Errorf("method latency %v", got)
	}
	if want := []csi.ControllerServiceCapability_RPC_Type{csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME, csi.ControllerServiceCapability_RPC_LIST_VOLUMES}; !slices.Equal(o.config.ControllerCapabilities, want) {
		t.Errorf("capabilities %v", o.config.ControllerCapabilities)
	}
	if !slices.Equal(o.config.Nodes, []string{"n1", "n2"}) || o.config.DriverName != testdriver.DefaultDriverName {
		t.Errorf("config %+v", o.config)
	}
}

func TestParseSnapshotFlags(t *testing.T) {
	o, err := parse(t, "--endpoint", "/tmp/a.sock",
		"--capabilities", "CREATE_DELETE_SNAPSHOT,LIST_SNAPSHOTS",
		"--snapshot-ready-after", "2s", "--snapshot-ready-polls", "3", "--group-controller=false")
	if err != nil {
		t.Fatal(err)
	}
	if c := o.config; c.SnapshotReadyAfter != 2*time.Second || c.SnapshotReadyAfterPolls != 3 || !c.DisableGroupController {
		t.Errorf("snapshot config %+v", c)
	}
	if _, err := testdriver.New(o.config); err != nil {
		t.Errorf("New: %v", err)
	}
}

func TestParseFlagsDefaults(t *testing.T) {
	o, err := parse(t, "--endpoint", "/tmp/a.sock")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(o.config.ControllerCapabilities, testdriver.DefaultControllerCapabilities()) {
		t.Errorf("default capabilities %v", o.config.ControllerCapabilities)
	}
	if o.config.Nodes != nil || o.config.DisableControllerService || o.config.DisableGroupController ||
		o.config.SnapshotReadyAfter != 0 || o.config.SnapshotReadyAfterPolls != 0 {
		t.Errorf("defaults %+v", o.config)
	}
}

func TestParseFlagsErrors(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"--endpoint", "/tmp/a.sock", "--method-latency", "CreateVolume"},
		{"--endpoint", "/tmp/a.sock", "--method-latency", "CreateVolume=fast"},
		{"--endpoint", "/tmp/a.sock", "--capabilities", "TELEPORT"},
		{"--endpoint", "/tmp/a.sock", "extra"},
		{"--endpoint", "/tmp/a.sock", "--snapshot-ready-polls", "many"},
	} {
		if _, err := parse(t, args...); err == nil {
			t.Errorf("parseFlags(%q) succeeded", args)
		}
	}
}
