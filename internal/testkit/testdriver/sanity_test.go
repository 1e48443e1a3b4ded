package testdriver_test

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// TestSanity runs the csi-test sanity suite's Identity, Controller and
// GroupController specs against the driver over a UNIX socket. Ginkgo allows one RunSpecs per
// process, so this is the only Ginkgo suite in the package.
func TestSanity(t *testing.T) {
	b, err := testdriver.New(testdriver.Config{
		// A little latency so that every call goes through the
		// asynchronous backend path.
		Latency: time.Millisecond,
		NodeID:  "sanity-node",
		// Only NodeID exists, so publishing to the random node ids
		// sanity makes up is NotFound, as the suite expects.
		Nodes: []string{},
		// Small, so that the attach limit spec is quick.
		MaxVolumesPerNode: 2,
		// Everything the driver implements, so that no Controller spec is
		// skipped for lack of a capability.
		ControllerCapabilities: testdriver.ImplementedControllerCapabilities(),
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	dir := t.TempDir()
	srv, err := b.Serve(filepath.Join(dir, "csi.sock"))
	if err != nil {
		t.Fatalf("Serve: %v", err)
	}
	defer srv.Stop()

	cfg := sanity.NewTestConfig()
	cfg.Address = srv.Socket()
	cfg.TargetPath = filepath.Join(dir, "target")
	cfg.StagingPath = filepath.Join(dir, "staging")
	// ModifyVolume specs send these; mutable_parameters is required by the
	// spec and only known keys are accepted.
	cfg.TestVolumeMutableParameters = map[string]string{"iops": "3000"}
	cfg.TestNodeVolumeAttachLimit = true
	cfg.TestSnapshotParameters = map[string]string{"type": "sanity"}
	// Snapshot secrets, so that the run also checks that the journal
	// records which secret keys each snapshot call got.
	cfg.SecretsFile = filepath.Join(dir, "secrets.yaml")
	secrets := "CreateSnapshotSecret: {create-key: v}\nDeleteSnapshotSecret: {delete-key: v}\n" +
		"ListSnapshotsSecret: {list-key: v}\nGetSnapshotSecret: {get-key: v}\n"
	if err := os.WriteFile(cfg.SecretsFile, []byte(secrets), 0o600); err != nil {
		t.Fatal(err)
	}

	sc := sanity.GinkgoTest(&cfg)
	defer sc.Finalize()
	gomega.RegisterFailHandler(ginkgo.Fail)
	suiteConfig, reporterConfig := ginkgo.GinkgoConfiguration()
	// The driver's Node service is a stub that only serves the Controller
	// specs (NodeGetInfo for a node id, NodeUnpublishVolume in cleanup); the
	// "Node Service" specs would test mounting, which the sidecars never use.
	// Ginkgo matches against the suite description followed by the spec's
	// container and leaf texts.
	const suite = "testdriver sanity"
	suiteConfig.SkipStrings = append(suiteConfig.SkipStrings, "^"+regexp.QuoteMeta(suite)+" Node Service ")
	ginkgo.RunSpecs(t, suite, suiteConfig, reporterConfig)

	// The suite runs its calls one at a time, so none may overlap.
	if o := b.Overlaps(); len(o) != 0 {
		t.Errorf("sequential sanity calls overlapped: %+v", o)
	}
	// Every snapshot call got its own secret, and snapshots and group
	// snapshots were exercised.
	wantKeys := map[string]string{
		testdriver.MethodCreateSnapshot:            "create-key",
		testdriver.MethodDeleteSnapshot:            "delete-key",
		testdriver.MethodListSnapshots:             "list-key",
		testdriver.MethodGetSnapshot:               "get-key",
		testdriver.MethodCreateVolumeGroupSnapshot: "create-key",
		testdriver.MethodDeleteVolumeGroupSnapshot: "delete-key",
		testdriver.MethodGetVolumeGroupSnapshot:    "list-key",
	}
	for method, want := range wantKeys {
		calls := b.Calls(method)
		if len(calls) == 0 {
			t.Errorf("sanity made no %s call", method)
		}
		for _, c := range calls {
			if c.SecretKeys != want {
				t.Errorf("%s call %d got secret keys %q, want %q", method, c.Seq, c.SecretKeys, want)
			}
		}
	}
}
