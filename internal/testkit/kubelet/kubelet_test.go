package kubelet

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
)

var kube controlplane.Shared

func TestMain(m *testing.M) { os.Exit(kube.Main(m, controlplane.Options{})) }

// waitCSINode polls the node's CSINode until ok accepts it (nil when it does not exist) and
// returns it, or fails t with the last one seen.
func waitCSINode(ctx context.Context, t *testing.T, client kubernetes.Interface, node string, ok func(*storagev1.CSINode) bool) *storagev1.CSINode {
	t.Helper()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		got, err := client.StorageV1().CSINodes().Get(ctx, node, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			got = nil
		case err != nil:
			t.Fatalf("get CSINode %s: %v", node, err)
		}
		if ok(got) {
			return got
		}
		select {
		case <-ctx.Done():
			t.Fatalf("CSINode %s: %v; last seen: %+v", node, ctx.Err(), got)
		case <-tick.C:
		}
	}
}

func TestNodeBecomesReadyWithItsCSINode(t *testing.T) {
	t.Parallel()
	cp := kube.Get(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	began := time.Now()
	k := Start(ctx, t, cp, Options{})
	t.Logf("node %s Ready %s after start", k.NodeName(), time.Since(began).Round(time.Millisecond))
	client := kubernetes.NewForConfigOrDie(cp.Config())
	csiNode := waitCSINode(ctx, t, client, k.NodeName(), func(n *storagev1.CSINode) bool { return n != nil })
	if len(csiNode.OwnerReferences) != 1 || csiNode.OwnerReferences[0].Name != k.NodeName() {
		t.Errorf("CSINode owners = %+v, want the Node %s", csiNode.OwnerReferences, k.NodeName())
	}
	if len(csiNode.Spec.Drivers) != 0 {
		t.Errorf("CSINode drivers = %+v, want none", csiNode.Spec.Drivers)
	}
	t.Logf("CSINode present %s after start", time.Since(began).Round(time.Millisecond))
	if fi, err := os.Stat(k.RegistrationDir()); err != nil || !fi.IsDir() {
		t.Errorf("registration dir %s: %v", k.RegistrationDir(), err)
	}
}

func TestAssetsNamesTheMissingBinaryAndHowToBuildIt(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(controlplane.AssetsEnv, dir)
	for _, bin := range []string{"etcd", "kube-apiserver"} {
		if err := os.WriteFile(filepath.Join(dir, bin), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_, err := Assets()
	if err == nil {
		t.Fatal("Assets() succeeded without hollow-kubelet")
	}
	for _, want := range []string{"make testenv", filepath.Join(dir, Binary) + " is missing"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Assets() error %q does not mention %q", err, want)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, Binary), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got, err := Assets(); err != nil || got != dir {
		t.Errorf("Assets() = %q, %v; want %q", got, err, dir)
	}
}
