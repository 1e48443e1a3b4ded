package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// The args of every csi-attacher, csi-provisioner, csi-resizer, csi-snapshotter,
// livenessprobe, node-driver-registrar and external-health-monitor-controller container in
// upstream's example manifests and well-known drivers' deployments, with the env the
// container defines: as the kubelet passes them ($(ADDRESS) expanded from that env), or, for
// the snapshotter's, exactly as the manifest writes them ($(ADDRESS) left as the value).
// Swapping the image must be enough: each args list must pass flag validation here.
var upstreamManifests = []struct {
	source  string
	sidecar string
	env     map[string]string
	args    []string
}{
	// kubernetes-csi/external-attacher v4.13.0 deploy/kubernetes/deployment.yaml
	{"external-attacher/deploy/kubernetes/deployment.yaml", "attacher",
		map[string]string{"MY_NAME": "csi-attacher-0"},
		[]string{"--v=5", "--csi-address=/var/lib/csi/sockets/pluginproxy/mock.socket", "--leader-election", "--http-endpoint=:8080"}},
	// kubernetes-csi/external-provisioner v6.4.0 deploy/kubernetes/deployment.yaml
	{"external-provisioner/deploy/kubernetes/deployment.yaml", "provisioner", nil,
		[]string{"--csi-address=/var/lib/csi/sockets/pluginproxy/mock.socket", "--leader-election", "--http-endpoint=:8080"}},
	// kubernetes-csi/external-provisioner v6.4.0 deploy/kubernetes/storage-capacity.yaml
	{"external-provisioner/deploy/kubernetes/storage-capacity.yaml", "provisioner",
		map[string]string{"NAMESPACE": "default", "POD_NAME": "csi-provisioner-0"},
		[]string{"--csi-address=/var/lib/csi/sockets/pluginproxy/mock.socket", "--leader-election", "--enable-capacity", "--capacity-ownerref-level=2"}},
	// kubernetes-csi/external-resizer v2.3.0 deploy/kubernetes/deployment.yaml
	{"external-resizer/deploy/kubernetes/deployment.yaml", "resizer", nil,
		[]string{"--v=5", "--csi-address=/var/lib/csi/sockets/pluginproxy/mock.socket", "--leader-election", "--http-endpoint=:8080"}},
	// kubernetes-csi/csi-driver-host-path v1.18.0 deploy/kubernetes-1.34/hostpath/csi-hostpath-plugin.yaml
	// (kubernetes-1.35 and kubernetes-latest are links to it; the -test variants carry the
	// same args in one StatefulSet per sidecar); v1.17.1 kubernetes-1.30 has the same args.
	{"csi-driver-host-path/deploy/kubernetes-1.34/hostpath csi-attacher", "attacher", nil,
		[]string{"--v=5", "--csi-address=/csi/csi.sock"}},
	{"csi-driver-host-path/deploy/kubernetes-1.34/hostpath csi-provisioner", "provisioner", nil,
		[]string{"-v=5", "--csi-address=/csi/csi.sock", "--feature-gates=Topology=true"}},
	// deploy/util/deploy-hostpath.sh adds this one for volume-mode conversion tests.
	{"csi-driver-host-path/deploy/util/deploy-hostpath.sh csi-provisioner", "provisioner", nil,
		[]string{"-v=5", "--csi-address=/csi/csi.sock", "--feature-gates=Topology=true", "--prevent-volume-mode-conversion=true"}},
	{"csi-driver-host-path/deploy/kubernetes-1.34/hostpath csi-resizer", "resizer", nil,
		[]string{"-v=5", "-csi-address=/csi/csi.sock"}},
	// csi-driver-host-path v1.18.0 deploy/kubernetes-distributed/hostpath/csi-hostpath-plugin.yaml
	{"csi-driver-host-path/deploy/kubernetes-distributed/hostpath csi-provisioner", "provisioner",
		map[string]string{"NODE_NAME": "node-1", "NAMESPACE": "default", "POD_NAME": "csi-hostpathplugin-abcde"},
		[]string{"-v=5", "--csi-address=/csi/csi.sock", "--feature-gates=Topology=true", "--enable-capacity",
			"--capacity-ownerref-level=0", "--node-deployment=true", "--strict-topology=true", "--immediate-topology=false", "--worker-threads=5"}},

	// kubernetes-csi/external-snapshotter v8.7.0 deploy/kubernetes/csi-snapshotter/setup-csi-snapshotter.yaml
	{"external-snapshotter/deploy/kubernetes/csi-snapshotter/setup-csi-snapshotter.yaml", "snapshotter",
		map[string]string{"ADDRESS": "/csi/csi.sock"},
		[]string{"--v=5", "--csi-address=$(ADDRESS)", "--leader-election=false"}},
	// csi-driver-host-path v1.18.0 deploy/kubernetes-1.34/hostpath/csi-hostpath-plugin.yaml
	// (kubernetes-1.35 and kubernetes-latest link to it); kubernetes-1.34-test's
	// csi-hostpath-snapshotter.yaml StatefulSet has the same args. kubernetes-distributed
	// runs no snapshotter.
	{"csi-driver-host-path/deploy/kubernetes-1.34/hostpath csi-snapshotter", "snapshotter", nil,
		[]string{"-v=5", "--csi-address=/csi/csi.sock"}},
	// kubernetes-sigs/aws-ebs-csi-driver v1.64.0 deploy/kubernetes/base/controller.yaml
	{"aws-ebs-csi-driver/deploy/kubernetes/base/controller.yaml csi-snapshotter", "snapshotter",
		map[string]string{"ADDRESS": "/var/lib/csi/sockets/pluginproxy/csi.sock"},
		[]string{"--csi-address=$(ADDRESS)", "--leader-election=true", "--v=2", "--extra-create-metadata",
			"--kube-api-qps=20", "--kube-api-burst=100", "--worker-threads=100", "--retry-interval-max=30m"}},
	// Its Helm chart (charts/aws-ebs-csi-driver/templates/controller.yaml, v1.64.0) rendered
	// with debugLogs and controller.enableMetrics: two args more than the base.
	{"aws-ebs-csi-driver/charts/aws-ebs-csi-driver controller.yaml csi-snapshotter (debugLogs, enableMetrics)", "snapshotter",
		map[string]string{"ADDRESS": "/var/lib/csi/sockets/pluginproxy/csi.sock"},
		[]string{"--csi-address=$(ADDRESS)", "--leader-election=true", "--v=7", "--extra-create-metadata",
			"--kube-api-qps=20", "--kube-api-burst=100", "--worker-threads=100", "--retry-interval-max=30m", "--http-endpoint=0.0.0.0:3306"}},
	// kubernetes-sigs/gcp-compute-persistent-disk-csi-driver v1.26.4
	// deploy/kubernetes/base/controller/controller.yaml (--metrics-address: deprecated, still
	// accepted, as upstream).
	{"gcp-compute-persistent-disk-csi-driver/deploy/kubernetes/base/controller/controller.yaml csi-snapshotter", "snapshotter",
		map[string]string{"PDCSI_NAMESPACE": "gce-pd-csi-driver"},
		[]string{"--v=5", "--csi-address=/csi/csi.sock", "--metrics-address=:22014", "--leader-election",
			"--leader-election-namespace=$(PDCSI_NAMESPACE)", "--timeout=300s", "--retry-interval-max=60s"}},
	// ceph/ceph-csi devel at 52fcb7b (October 2024, after v3.12.2; the newest copy at hand)
	// deploy/nfs/kubernetes/csi-nfsplugin-provisioner.yaml. Its rbd and cephfs manifests are
	// in TestArgsCSISnapshotterV87RefusesAreRefused.
	{"ceph-csi/deploy/nfs/kubernetes/csi-nfsplugin-provisioner.yaml csi-snapshotter", "snapshotter",
		map[string]string{"ADDRESS": "unix:///csi/csi-provisioner.sock", "POD_IP": "10.0.0.7"},
		[]string{"--csi-address=$(ADDRESS)", "--v=1", "--timeout=150s", "--leader-election=true", "--http-endpoint=$(POD_IP):8092"}},

	// kubernetes-csi/csi-driver-host-path v1.18.0 deploy/kubernetes-1.34/hostpath/csi-hostpath-plugin.yaml
	// (livenessprobe v2.19.0; kubernetes-distributed has the same args).
	{"csi-driver-host-path/deploy/kubernetes-1.34/hostpath liveness-probe", "livenessprobe", nil,
		[]string{"--csi-address=/csi/csi.sock", "--health-port=9898"}},
	// kubernetes-sigs/aws-ebs-csi-driver v1.64.0 deploy/kubernetes/base/node.yaml and
	// controller.yaml (livenessprobe v2.19.0).
	{"aws-ebs-csi-driver/deploy/kubernetes/base/node.yaml liveness-probe", "livenessprobe", nil,
		[]string{"--csi-address=/csi/csi.sock"}},
	{"aws-ebs-csi-driver/deploy/kubernetes/base/controller.yaml liveness-probe", "livenessprobe", nil,
		[]string{"--csi-address=/csi/csi.sock", "--probe-timeout=60s"}},
	// Its Helm chart's controller.yaml (v1.64.0) with controller.enableMetrics: metrics on a
	// listener of their own, the probe on its default port.
	{"aws-ebs-csi-driver/charts/aws-ebs-csi-driver controller.yaml liveness-probe (enableMetrics)", "livenessprobe", nil,
		[]string{"--csi-address=/csi/csi.sock", "--probe-timeout=60s", "--metrics-address=0.0.0.0:3305"}},
	// Its Helm chart's node DaemonSet (templates/_node.tpl, v1.64.0) rendered with the
	// chart's defaults has the base's args; sidecars.livenessProbe.additionalArgs is empty.

	// kubernetes-csi/csi-driver-host-path v1.18.0 deploy/kubernetes-1.34/hostpath/csi-hostpath-plugin.yaml
	// (node-driver-registrar v2.17.0; kubernetes-1.34-test and kubernetes-distributed have
	// the same args). KUBE_NODE_NAME is in its env, unused by the args.
	{"csi-driver-host-path/deploy/kubernetes-1.34/hostpath node-driver-registrar", "node-driver-registrar",
		map[string]string{"KUBE_NODE_NAME": "node-1"},
		[]string{"--v=5", "--csi-address=/csi/csi.sock", "--kubelet-registration-path=/var/lib/kubelet/plugins/csi-hostpath/csi.sock", "--http-endpoint=:9809"}},
	// kubernetes-sigs/aws-ebs-csi-driver v1.64.0 deploy/kubernetes/base/node.yaml
	// (node-driver-registrar v2.17.0): $(ADDRESS) and $(DRIVER_REG_SOCK_PATH) expanded from
	// the container's env.
	{"aws-ebs-csi-driver/deploy/kubernetes/base/node.yaml node-driver-registrar", "node-driver-registrar",
		map[string]string{"ADDRESS": "/csi/csi.sock", "DRIVER_REG_SOCK_PATH": "/var/lib/kubelet/plugins/ebs.csi.aws.com/csi.sock"},
		[]string{"--csi-address=/csi/csi.sock", "--kubelet-registration-path=/var/lib/kubelet/plugins/ebs.csi.aws.com/csi.sock",
			"--http-endpoint=0.0.0.0:9809", "--v=2"}},
	// Its Helm chart's node DaemonSet (charts/aws-ebs-csi-driver/templates/_node.tpl,
	// v1.64.0) rendered with the chart's defaults (node.kubeletPath /var/lib/kubelet,
	// sidecars.nodeDriverRegistrar.healthPort 9809 and logLevel 2, no additionalArgs): the
	// base's args, which are generated from it; with debugLogs, --v=7 instead.
	{"aws-ebs-csi-driver/charts/aws-ebs-csi-driver _node.tpl node-driver-registrar (defaults)", "node-driver-registrar",
		map[string]string{"ADDRESS": "/csi/csi.sock", "DRIVER_REG_SOCK_PATH": "/var/lib/kubelet/plugins/ebs.csi.aws.com/csi.sock"},
		[]string{"--csi-address=/csi/csi.sock", "--kubelet-registration-path=/var/lib/kubelet/plugins/ebs.csi.aws.com/csi.sock",
			"--http-endpoint=0.0.0.0:9809", "--v=2"}},
	{"aws-ebs-csi-driver/charts/aws-ebs-csi-driver _node.tpl node-driver-registrar (debugLogs)", "node-driver-registrar",
		map[string]string{"ADDRESS": "/csi/csi.sock", "DRIVER_REG_SOCK_PATH": "/var/lib/kubelet/plugins/ebs.csi.aws.com/csi.sock"},
		[]string{"--csi-address=/csi/csi.sock", "--kubelet-registration-path=/var/lib/kubelet/plugins/ebs.csi.aws.com/csi.sock",
			"--http-endpoint=0.0.0.0:9809", "--v=7"}},
	// kubernetes-sigs/gcp-compute-persistent-disk-csi-driver v1.26.4
	// deploy/kubernetes/base/node_linux/node.yaml (no health endpoint; KUBE_NODE_NAME in its
	// env, unused by the args).
	{"gcp-compute-persistent-disk-csi-driver/deploy/kubernetes/base/node_linux/node.yaml csi-driver-registrar", "node-driver-registrar",
		map[string]string{"KUBE_NODE_NAME": "node-1"},
		[]string{"--v=5", "--csi-address=/csi/csi.sock", "--kubelet-registration-path=/var/lib/kubelet/plugins/pd.csi.storage.gke.io/csi.sock"}},

	// kubernetes-csi/csi-driver-host-path v1.18.0 deploy/kubernetes-1.34/hostpath/csi-hostpath-plugin.yaml
	// (external-health-monitor-controller v0.18.0; kubernetes-1.34-test has the same args):
	// $(ADDRESS) expanded from the container's env.
	{"csi-driver-host-path/deploy/kubernetes-1.34/hostpath csi-external-health-monitor-controller", "health-monitor",
		map[string]string{"ADDRESS": "/csi/csi.sock"},
		[]string{"--v=5", "--csi-address=/csi/csi.sock", "--leader-election"}},
}

func TestUpstreamManifestArgsPassFlagValidation(t *testing.T) {
	for _, m := range upstreamManifests {
		t.Run(m.source, func(t *testing.T) {
			for k, v := range m.env {
				t.Setenv(k, v)
			}
			if err := lifecycle.ValidateArgs(newRoot(), append([]string{m.sidecar}, m.args...)); err != nil {
				t.Errorf("%s %v: %v", m.sidecar, m.args, err)
			}
		})
	}
}

// Values upstream accepts must not be refused here (a warning at most), and the flags
// upstream's binaries have must exist.
func TestValuesAndFlagsUpstreamAcceptsAreAccepted(t *testing.T) {
	for _, args := range [][]string{
		{"attacher", "--kube-api-qps=0", "--kube-api-burst=0"},
		{"attacher", "--kube-api-qps=-1"},
		{"attacher", "--reconcile-sync=0", "--retry-interval-start=0", "--timeout=0", "--max-entries=-1", "--resync=0"},
		{"attacher", "--max-grpc-log-length=100"},
		{"provisioner", "--snapshot-orphan-sweep-interval=0", "--worker-threads=0", "--capacity-poll-interval=0", "--retry-interval-start=0"},
		{"provisioner", "--enable-pprof", "--http-endpoint=:8080", "--master=https://127.0.0.1:6443"},
		{"provisioner", "--volume-name-prefix=", "--timeout=0"},
		{"resizer", "--workers=0", "--timeout=0", "--master=https://127.0.0.1:6443", "--retry-interval-max=1ms"},
		{"resizer", "--leader-election-labels=a:b", "--leader-election-labels=c:d"},
		{"resizer", "--log-flush-frequency=10s"},
		{"resizer", "--resize-timeout=1m", "--modify-timeout=2m", "--timeout=0"},
		// Removed in v2.3.0, which refuses it; accepted here, without effect, for manifests
		// written for v2.2.
		{"resizer", "--feature-gates=RecoverVolumeExpansionFailure=true"},
		{"resizer", "--feature-gates=RecoverVolumeExpansionFailure=false,AnnotateFsResize=false"},
		{"--controllers=resizer", "--resizer-timeout=5s", "--resizer-resize-timeout=1m", "--resizer-modify-timeout=2m"},
		// livenessprobe v2.19 compares --health-port with the string "9808": given
		// explicitly it goes with --http-endpoint. It checks no value of its own flags.
		{"livenessprobe", "--health-port=9808", "--http-endpoint=:8080"},
		{"livenessprobe", "--probe-timeout=0", "--health-port=not-a-port"},
		{"livenessprobe", "-csi-address", "/csi/csi.sock", "-health-port", "9898", "-probe-timeout", "3s"},
		// In combined mode the probe's port and the diagnostics are two servers.
		{"--controllers=livenessprobe,attacher", "--livenessprobe-health-port=9898", "--http-endpoint=:8080"},
	} {
		if err := lifecycle.ValidateArgs(newRoot(), args); err != nil {
			t.Errorf("%v: %v", args, err)
		}
	}
}

// ceph-csi's rbd and cephfs provisioners (devel at 52fcb7b, and v3.12.2) run csi-snapshotter
// v8.0.1 with --enable-volume-group-snapshots, which v8.2 replaced by the
// CSIVolumeGroupSnapshot feature gate: csi-snapshotter v8.7 refuses these args ("flag
// provided but not defined"), and so does csi-sidecars, naming the flag. The same args
// with the gate in its place pass.
func TestArgsCSISnapshotterV87RefusesAreRefused(t *testing.T) {
	t.Setenv("ADDRESS", "unix:///csi/csi-provisioner.sock")
	t.Setenv("POD_IP", "10.0.0.7")
	for _, source := range []string{
		"ceph-csi/deploy/rbd/kubernetes/csi-rbdplugin-provisioner.yaml",
		"ceph-csi/deploy/cephfs/kubernetes/csi-cephfsplugin-provisioner.yaml",
	} {
		args := []string{"snapshotter", "--csi-address=$(ADDRESS)", "--v=1", "--timeout=150s", "--leader-election=true",
			"--extra-create-metadata=true", "--enable-volume-group-snapshots=true", "--http-endpoint=$(POD_IP):8092"}
		err := lifecycle.ValidateArgs(newRoot(), args)
		if err == nil || !strings.Contains(err.Error(), "--enable-volume-group-snapshots") {
			t.Errorf("%s %v: %v; want it refused naming --enable-volume-group-snapshots, as csi-snapshotter v8.7 refuses it", source, args, err)
		}
		args[6] = "--feature-gates=CSIVolumeGroupSnapshot=true"
		if err := lifecycle.ValidateArgs(newRoot(), args); err != nil {
			t.Errorf("%s with the feature gate instead %v: %v", source, args, err)
		}
	}
}

// csiSnapshotterFlags are the flags csi-snapshotter v8.7.0 registers, each with a value
// other than its default: its own (cmd/csi-snapshotter/main.go), csi-lib-utils v0.25.0's
// standardflags (RegisterCommonFlags, AddAutomaxprocs) and component-base's logging flags
// (logsapi.AddGoFlags, JSON registered). Some exclude others, so they come in groups that
// are each valid; every group runs with the first.
var csiSnapshotterFlags = struct {
	own, shared []string
	// Groups that cannot go with shared: each is checked with own, its own flags and env.
	apart []struct {
		why         string
		env         map[string]string
		own, shared []string
	}
}{
	own: []string{
		"--resync-period=5m",
		"--snapshot-name-prefix=snap",
		"--snapshot-name-uuid-length=8",
		"--worker-threads=4",
		"--timeout=2m",
		"--extra-create-metadata",
		"--retry-interval-start=2s",
		"--retry-interval-max=10m",
		"--groupsnapshot-name-prefix=group",
		"--groupsnapshot-name-uuid-length=12",
	},
	shared: []string{
		"--feature-gates=CSIVolumeGroupSnapshot=false,ReleaseLeaderElectionOnExit=true",
		"--kubeconfig=/etc/kubernetes/snapshotter.kubeconfig",
		"--csi-address=/run/csi/driver.sock",
		"--leader-election",
		"--leader-election-namespace=kube-system",
		"--leader-election-lease-duration=30s",
		"--leader-election-renew-deadline=20s",
		"--leader-election-retry-period=10s",
		"--leader-election-labels=team:storage,tier:controller",
		"--kube-api-qps=50",
		"--kube-api-burst=100",
		"--http-endpoint=:9808",
		"--metrics-path=/snapshotter-metrics",
		"--automaxprocs",
		"--v=5",
		"--vmodule=content*=6",
		"--log-flush-frequency=10s",
		// Alpha: upstream refuses any other value, having no way to enable
		// LoggingAlphaOptions (its --feature-gates does not hold the logging gates).
		"--log-text-split-stream=false",
		"--log-text-info-buffer-size=0",
		"--log-json-split-stream=false",
		"--log-json-info-buffer-size=0",
	},
	apart: []struct {
		why         string
		env         map[string]string
		own, shared []string
	}{
		{"--node-deployment refuses --leader-election and needs $NODE_NAME", map[string]string{"NODE_NAME": "node-1"},
			[]string{"--node-deployment"}, []string{"--leader-election=false"}},
		{"--metrics-address excludes --http-endpoint", nil, nil, []string{"--metrics-address=:9809"}},
		{"--logging-format=json excludes --vmodule", nil, nil, []string{"--logging-format=json"}},
		{"--version prints the version and exits", nil, nil, []string{"--version"}},
	},
}

// Every flag csi-snapshotter v8.7 has is accepted by `csi-sidecars snapshotter` with a
// value other than its default, alone and in combined mode (own flags with the prefix).
func TestEveryCSISnapshotterFlagIsAccepted(t *testing.T) {
	f := csiSnapshotterFlags
	check := func(t *testing.T, args []string) {
		t.Helper()
		if err := lifecycle.ValidateArgs(newRoot(), args); err != nil {
			t.Errorf("%v: %v", args, err)
		}
	}
	prefixed := func(own ...[]string) []string {
		var out []string
		for _, a := range slices.Concat(own...) {
			out = append(out, "--snapshotter-"+strings.TrimPrefix(a, "--"))
		}
		return out
	}
	t.Run("together", func(t *testing.T) {
		check(t, slices.Concat([]string{"snapshotter"}, f.own, f.shared))
		check(t, slices.Concat([]string{"--controllers=snapshotter"}, prefixed(f.own), f.shared))
	})
	for _, g := range f.apart {
		t.Run(g.why, func(t *testing.T) {
			for k, v := range g.env {
				t.Setenv(k, v)
			}
			check(t, slices.Concat([]string{"snapshotter"}, f.own, g.own, g.shared))
			check(t, slices.Concat([]string{"--controllers=snapshotter"}, prefixed(f.own, g.own), g.shared))
		})
	}
	// Upstream's flag package takes one dash as well as two, and values after a space.
	t.Run("go flag spellings", func(t *testing.T) {
		check(t, []string{"snapshotter", "-csi-address", "/csi/csi.sock", "-leader-election", "-timeout", "90s",
			"-worker-threads", "2", "-extra-create-metadata=true", "-snapshot-name-uuid-length", "-1", "-v", "3"})
	})
}

// Combined mode takes KEP-4958's form: --controllers picks the sidecars, their own flags
// carry their name as prefix, shared flags come once. What a sidecar refuses alone it
// refuses here too, naming the sidecar.
func TestCombinedModeFlags(t *testing.T) {
	for _, c := range []struct {
		args    []string
		wantErr string
	}{
		{[]string{"--controllers=attacher,provisioner,resizer", "--csi-address=/csi/csi.sock", "--leader-election",
			"--attacher-worker-threads=5", "--provisioner-timeout=30s", "--resizer-workers=3", "--feature-gates=Topology=true"}, ""},
		{[]string{"--controllers=attacher", "--controllers=resizer"}, ""},
		{[]string{"--controllers=attacher,provisioner,resizer,snapshotter", "--snapshotter-worker-threads=3",
			"--snapshotter-extra-create-metadata", "--feature-gates=CSIVolumeGroupSnapshot=false"}, ""},
		{[]string{"--controllers=attacher,cloner"}, "--controllers"},
		{[]string{"--controllers=snapshotter", "--snapshotter-snapshot-name-prefix="}, "--snapshot-name-prefix"},
		{[]string{"--controllers=snapshotter", "--snapshotter-node-deployment", "--leader-election"}, "--node-deployment"},
		// Upstream checks the group prefix only where group snapshots are on (at start).
		{[]string{"--controllers=snapshotter", "--snapshotter-groupsnapshot-name-prefix=", "--feature-gates=CSIVolumeGroupSnapshot=false"}, ""},
		{[]string{"--controllers=attacher", "--attacher-worker-threads=0"}, "--worker-threads"},
		{[]string{"--controllers=attacher", "--worker-threads=5"}, "unknown flag"},
		// As livenessprobe v2.19 (which exits 1 on them; a usage error, exit 2, here).
		{[]string{"livenessprobe", "--health-port=9898", "--http-endpoint=:8080"}, "--health-port"},
		{[]string{"livenessprobe", "--metrics-address=:9809", "--http-endpoint=:8080"}, "--metrics-address"},
	} {
		err := lifecycle.ValidateArgs(newRoot(), c.args)
		if (c.wantErr == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.wantErr)) {
			t.Errorf("%v: %v, want %q", c.args, err, c.wantErr)
		}
	}
}
