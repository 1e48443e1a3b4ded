package resizer

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/queuenames"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	"github.com/spf13/pflag"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	fakediscovery "k8s.io/client-go/discovery/fake"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"
	"k8s.io/component-base/featuregate"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// The flags are upstream's, with upstream's defaults (P9).
func TestFlagDefaultsAreUpstreams(t *testing.T) {
	fs := pflag.NewFlagSet("resizer", pflag.ContinueOnError)
	New().AddFlags(fs)
	for name, want := range map[string]string{
		"workers": "10", "timeout": "10s", "resize-timeout": "10s", "modify-timeout": "10s", "resync-period": "10m0s",
		"retry-interval-start": "1s", "retry-interval-max": "5m0s",
		"handle-volume-inuse-error": "true", "extra-modify-metadata": "false",
	} {
		f := fs.Lookup(name)
		if f == nil {
			t.Errorf("--%s missing", name)
			continue
		}
		if f.DefValue != want {
			t.Errorf("--%s default %s, want %s", name, f.DefValue, want)
		}
	}
	gates := featuregate.NewFeatureGate()
	if err := gates.Add(New().Features()); err != nil {
		t.Fatal(err)
	}
	// Upstream v2.3.0's defaults.
	for g, want := range map[featuregate.Feature]bool{AnnotateFsResize: true, VolumeAttributesClass: true} {
		if gates.Enabled(g) != want {
			t.Errorf("gate %s on by default: %v, want %v", g, gates.Enabled(g), want)
		}
	}
}

// As upstream v2.3.0: each expand call has --resize-timeout, each modify call
// --modify-timeout, unless --timeout is set on the command line, even to its default: then
// it is the timeout of both. --timeout also bounds the driver probes at start.
func TestCallTimeouts(t *testing.T) {
	for _, c := range []struct {
		args                  []string
		expand, modify, probe time.Duration
	}{
		{nil, 10 * time.Second, 10 * time.Second, 10 * time.Second},
		{[]string{"--resize-timeout=1m", "--modify-timeout=2m"}, time.Minute, 2 * time.Minute, 10 * time.Second},
		{[]string{"--timeout=30s", "--resize-timeout=1m", "--modify-timeout=2m"}, 30 * time.Second, 30 * time.Second, 30 * time.Second},
		{[]string{"--resize-timeout=1m", "--timeout=10s"}, 10 * time.Second, 10 * time.Second, 10 * time.Second},
	} {
		s := New()
		fs := pflag.NewFlagSet("resizer", pflag.ContinueOnError)
		s.AddFlags(fs)
		if err := fs.Parse(c.args); err != nil {
			t.Fatal(err)
		}
		expand, modify := s.callTimeouts()
		if expand != c.expand || modify != c.modify || s.CallTimeout() != c.probe {
			t.Errorf("%v: expand %v, modify %v, probe %v; want %v, %v, %v", c.args, expand, modify, s.CallTimeout(), c.expand, c.modify, c.probe)
		}
	}
}

// Upstream validates none of the resizer's own flags: odd values get a warning, not exit 2.
func TestValidateFlags(t *testing.T) {
	for _, args := range [][]string{{"--workers=0"}, {"--timeout=0s"}, {"--resize-timeout=0s"}, {"--modify-timeout=-1s"}, {"--retry-interval-start=0s"}, {"--retry-interval-start=10s", "--retry-interval-max=1s"}} {
		s := New()
		fs := pflag.NewFlagSet("resizer", pflag.ContinueOnError)
		s.AddFlags(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		if err := s.ValidateFlags(); err != nil {
			t.Errorf("%v refused: %v", args, err)
		}
	}
	if err := New().ValidateFlags(); err != nil {
		t.Errorf("defaults rejected: %v", err)
	}
}

func TestLeaseName(t *testing.T) {
	if got := lifecycle.SanitizeName(New().LeaseName("hostpath.csi.k8s.io")); got != "external-resizer-hostpath-csi-k8s-io" {
		t.Errorf("lease %q", got)
	}
}

// Which controllers run for which driver, and the start-up refusals (exit 2).
func TestCapabilities(t *testing.T) {
	vacServed := []*metav1.APIResourceList{{GroupVersion: "storage.k8s.io/v1", APIResources: []metav1.APIResource{{Name: "volumeattributesclasses"}}}}
	expand, modify := csi.ControllerServiceCapability_RPC_EXPAND_VOLUME, csi.ControllerServiceCapability_RPC_MODIFY_VOLUME
	for _, tc := range []struct {
		name          string
		noController  bool
		ctrlCaps      []csi.ControllerServiceCapability_RPC_Type
		nodeExpansion bool
		served        []*metav1.APIResourceList
		gates         map[string]bool
		// discoveryFails is how many discovery requests fail before the API server answers;
		// -1: all of them.
		discoveryFails int
		wantMode       string // "" no expansion
		wantModify     bool
		wantUsage      bool
	}{
		{name: "controller expansion and modify", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{expand, modify}, served: vacServed, wantMode: "ControllerExpandVolume", wantModify: true},
		{name: "node expansion only: trivial resizer", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{}, nodeExpansion: true, wantMode: "node only (trivial resizer)"},
		{name: "modify only", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{modify}, served: vacServed, wantModify: true},
		{name: "modify capability, API server without v1 VAC: gate off by discovery", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{expand, modify}, wantMode: "ControllerExpandVolume"},
		{name: "gate set explicitly: discovery not consulted", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{expand, modify}, gates: map[string]bool{"VolumeAttributesClass": true}, wantMode: "ControllerExpandVolume", wantModify: true},
		{name: "gate turned off", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{expand, modify}, served: vacServed, gates: map[string]bool{"VolumeAttributesClass": false}, wantMode: "ControllerExpandVolume"},
		{name: "modify only but gate off: nothing to do", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{modify}, served: vacServed, gates: map[string]bool{"VolumeAttributesClass": false}, wantUsage: true},
		{name: "discovery fails at first, then serves VAC: retried", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{expand, modify}, served: vacServed, discoveryFails: 2, wantMode: "ControllerExpandVolume", wantModify: true},
		{name: "discovery fails at first, then no v1 VAC: off", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{expand, modify}, discoveryFails: 2, wantMode: "ControllerExpandVolume"},
		{name: "discovery keeps failing: gate left on, as upstream", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{expand, modify}, discoveryFails: -1, wantMode: "ControllerExpandVolume", wantModify: true},
		{name: "modify only, discovery keeps failing: starts", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{modify}, discoveryFails: -1, wantModify: true},
		{name: "neither expansion nor modification", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{}, wantUsage: true},
		{name: "no controller service", noController: true, wantUsage: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, testdriver.Config{NodeExpansion: tc.nodeExpansion, ControllerCapabilities: tc.ctrlCaps, DisableControllerService: tc.noController})
			kube := fake.NewClientset()
			disc := kube.Discovery().(*fakediscovery.FakeDiscovery)
			disc.Resources = tc.served
			failed := 0
			disc.PrependReactor("get", "resource", func(k8stesting.Action) (bool, runtime.Object, error) {
				if tc.discoveryFails >= 0 && failed >= tc.discoveryFails {
					return false, nil, nil
				}
				failed++
				return true, nil, apierrors.NewServiceUnavailable("injected")
			})
			gates := featuregate.NewFeatureGate()
			if err := gates.Add(New().Features()); err != nil {
				t.Fatal(err)
			}
			if err := gates.SetFromMap(tc.gates); err != nil {
				t.Fatal(err)
			}
			plugin, err := rpc.GetPluginCapabilities(context.Background(), f.conn)
			if err != nil {
				t.Fatal(err)
			}
			ctrl := rpc.ControllerCapabilitySet{}
			if !tc.noController {
				if ctrl, err = rpc.GetControllerCapabilities(context.Background(), f.conn); err != nil {
					t.Fatal(err)
				}
			}
			env := lifecycle.Env{Kube: kube, CSI: f.conn, DriverName: testDriver, PluginCapabilities: plugin, ControllerCapabilities: ctrl, Gates: gates}.WithOps(context.Background())
			s := New()
			s.discoveryBackoff = wait.Backoff{Duration: time.Millisecond, Factor: 1, Steps: 4}
			caps, err := s.capabilities(env)
			if tc.wantUsage {
				if !lifecycle.IsUsageError(err) {
					t.Fatalf("got %v, want a usage error (exit 2)", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			mode := ""
			if caps.expand != nil {
				mode = caps.expand.mode()
			}
			if mode != tc.wantMode || (caps.modify != nil) != tc.wantModify {
				t.Errorf("expansion %q modify %v, want %q %v", mode, caps.modify != nil, tc.wantMode, tc.wantModify)
			}
			if tc.discoveryFails > 0 && failed != tc.discoveryFails {
				t.Errorf("%d discovery requests failed, want %d before the answer", failed, tc.discoveryFails)
			}
		})
	}
}

// The queues report client-go's workqueue metrics under upstream's name, "<driver>-pvc",
// and never two under one name: beside the expansion queue the modification queue takes
// "<driver>-modify-pvc" (upstream gives both the same name, so their series mix).
func TestQueueNames(t *testing.T) {
	vacServed := []*metav1.APIResourceList{{GroupVersion: "storage.k8s.io/v1", APIResources: []metav1.APIResource{{Name: "volumeattributesclasses"}}}}
	expand, modify := csi.ControllerServiceCapability_RPC_EXPAND_VOLUME, csi.ControllerServiceCapability_RPC_MODIFY_VOLUME
	for _, tc := range []struct {
		name          string
		ctrlCaps      []csi.ControllerServiceCapability_RPC_Type
		nodeExpansion bool
		want          []string
	}{
		{name: "expansion and modification", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{expand, modify}, want: []string{testDriver + "-pvc", testDriver + "-modify-pvc"}},
		{name: "controller expansion only", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{expand}, want: []string{testDriver + "-pvc"}},
		{name: "node expansion only (trivial resizer)", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{}, nodeExpansion: true, want: []string{testDriver + "-pvc"}},
		{name: "modification only", ctrlCaps: []csi.ControllerServiceCapability_RPC_Type{modify}, want: []string{testDriver + "-pvc"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, testdriver.Config{NodeExpansion: tc.nodeExpansion, ControllerCapabilities: tc.ctrlCaps})
			kube := fake.NewClientset()
			kube.Discovery().(*fakediscovery.FakeDiscovery).Resources = vacServed
			gates := featuregate.NewFeatureGate()
			if err := gates.Add(New().Features()); err != nil {
				t.Fatal(err)
			}
			plugin, err := rpc.GetPluginCapabilities(context.Background(), f.conn)
			if err != nil {
				t.Fatal(err)
			}
			ctrl, err := rpc.GetControllerCapabilities(context.Background(), f.conn)
			if err != nil {
				t.Fatal(err)
			}
			events := record.NewBroadcaster()
			t.Cleanup(events.Shutdown)
			env := lifecycle.Env{
				Kube: kube, CSI: f.conn, DriverName: testDriver, PluginCapabilities: plugin, ControllerCapabilities: ctrl, Gates: gates,
				Informers: informers.NewSharedInformerFactory(kube, 0), Events: events,
			}.WithOps(context.Background())
			names := &queuenames.Recorder{}
			s := New()
			s.queueMetrics = names
			if err := s.Setup(env); err != nil {
				t.Fatal(err)
			}
			if got := names.Names(); !slices.Equal(got, tc.want) {
				t.Errorf("queues %q, want %q", got, tc.want)
			}
		})
	}
}
