package main

import (
	"strings"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// The args of every csi-attacher, csi-provisioner and csi-resizer container in upstream's
// example manifests, as the kubelet passes them ($(ADDRESS) expanded from the container's
// env), with the env the container defines. Swapping the image must be enough: each args
// list must pass flag validation here.
var upstreamManifests = []struct {
	source  string
	sidecar string
	env     map[string]string
	args    []string
}{
	// kubernetes-csi/external-attacher v4.12.0 deploy/kubernetes/deployment.yaml
	{"external-attacher/deploy/kubernetes/deployment.yaml", "attacher",
		map[string]string{"MY_NAME": "csi-attacher-0"},
		[]string{"--v=5", "--csi-address=/var/lib/csi/sockets/pluginproxy/mock.socket", "--leader-election", "--http-endpoint=:8080"}},
	// kubernetes-csi/external-provisioner v6.3.0 deploy/kubernetes/deployment.yaml
	{"external-provisioner/deploy/kubernetes/deployment.yaml", "provisioner", nil,
		[]string{"--csi-address=/var/lib/csi/sockets/pluginproxy/mock.socket", "--leader-election", "--http-endpoint=:8080"}},
	// kubernetes-csi/external-provisioner v6.3.0 deploy/kubernetes/storage-capacity.yaml
	{"external-provisioner/deploy/kubernetes/storage-capacity.yaml", "provisioner",
		map[string]string{"NAMESPACE": "default", "POD_NAME": "csi-provisioner-0"},
		[]string{"--csi-address=/var/lib/csi/sockets/pluginproxy/mock.socket", "--leader-election", "--enable-capacity", "--capacity-ownerref-level=2"}},
	// kubernetes-csi/external-resizer v2.2.1 deploy/kubernetes/deployment.yaml
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
	} {
		if err := lifecycle.ValidateArgs(newRoot(), args); err != nil {
			t.Errorf("%v: %v", args, err)
		}
	}
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
		{[]string{"--controllers=attacher", "--attacher-worker-threads=0"}, "--worker-threads"},
		{[]string{"--controllers=attacher", "--worker-threads=5"}, "unknown flag"},
	} {
		err := lifecycle.ValidateArgs(newRoot(), c.args)
		if (c.wantErr == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.wantErr)) {
			t.Errorf("%v: %v, want %q", c.args, err, c.wantErr)
		}
	}
}
