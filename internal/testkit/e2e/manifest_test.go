package e2e

import (
	"slices"
	"strings"
	"testing"
)

const manifest = `apiVersion: v1
kind: ServiceAccount
metadata: {name: sa}
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: plugin}
spec:
  selector: {matchLabels: {app: x}}
  template:
    metadata: {labels: {app: x}}
    spec:
      containers:
      - name: sidecars
        image: csi-sidecars:test
        args: ["--csi-address=$(ADDRESS)", "-v=5", "--http-endpoint=:9809", "--cost=$$(ADDRESS)", "--other=$(MISSING)"]
        env:
        - {name: ADDRESS, value: /csi/csi.sock}
        - {name: NODE, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
        - {name: SOCK, value: "$(ADDRESS).reg"}
`

// A manifest's container runs with its env and its $(VAR) references expanded, as the
// kubelet gives them, and with only the flags a test substitutes changed.
func TestManifestContainersRunAsTheKubeletWouldStartThem(t *testing.T) {
	pod, err := PodSpec([]byte(manifest), "StatefulSet", "plugin")
	if err != nil {
		t.Fatal(err)
	}
	if len(pod.Spec.Containers) != 1 {
		t.Fatalf("containers %v, want 1", pod.Spec.Containers)
	}
	c := pod.Spec.Containers[0]
	env, err := ContainerEnv(c, map[string]string{"spec.nodeName": "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	if got := EnvList(c, env); !slices.Equal(got, []string{"ADDRESS=/csi/csi.sock", "NODE=node-1", "SOCK=/csi/csi.sock.reg"}) {
		t.Errorf("env %q", got)
	}
	args := ExpandArgs(c.Args, env)
	want := []string{"--csi-address=/csi/csi.sock", "-v=5", "--http-endpoint=:9809", "--cost=$(ADDRESS)", "--other=$(MISSING)"}
	if !slices.Equal(args, want) {
		t.Errorf("expanded args %q, want %q", args, want)
	}
	set, err := SetFlags(args, map[string]string{"csi-address": "unix:///tmp/x.sock", "v": "2"})
	if err != nil {
		t.Fatal(err)
	}
	want = []string{"--csi-address=unix:///tmp/x.sock", "--v=2", "--http-endpoint=:9809", "--cost=$(ADDRESS)", "--other=$(MISSING)"}
	if !slices.Equal(set, want) {
		t.Errorf("substituted args %q, want %q", set, want)
	}
	if _, err := SetFlags(args, map[string]string{"kubeconfig": "k"}); err == nil || !strings.Contains(err.Error(), "kubeconfig") {
		t.Errorf("substituting a flag that is not there: %v, want an error naming it", err)
	}
	if _, err := ContainerEnv(c, nil); err == nil || !strings.Contains(err.Error(), "spec.nodeName") {
		t.Errorf("a field the test does not give: %v, want an error naming it", err)
	}
	if _, err := PodSpec([]byte(manifest), "Deployment", "plugin"); err == nil {
		t.Error("a workload the manifest lacks: no error")
	}
}
