// Package scale checks that a handover stays cheap when the sidecars' caches hold many
// objects: thousands of PersistentVolumes bound to claims and attached, all settled, plus a
// little fresh work in flight at the SIGTERM. Per sidecar, two replicas (leader and warm
// standby) run, each with a ServiceAccount of its own, so the API server's audit log tells
// their requests apart; the test SIGTERMs the leader mid-flight and reads what the new
// leader asked the API server for in its first seconds (any LIST, any write to a settled
// object), when its first CSI call came, and each replica's peak memory.
//
// The benchmark (10,000 objects, make bench) prints the figures; the short test (300
// objects, make test) asserts only what must hold whatever the machine: the handover
// happened and the new leader listed nothing.
package scale

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
)

var (
	kube   controlplane.Shared
	binDir string
	// auditLog is the API server's audit log (JSON lines, audit.k8s.io/v1 Events).
	auditLog string
)

// auditPolicy logs every request of a ServiceAccount (the replicas run as ServiceAccounts
// of their own) at Metadata level, and the admin's GET /version, which the tests send as a
// marker to know the log has been written up to a moment. Nothing else is logged: the
// tests' own bulk writes would only make the log slow to read.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
` + audit.MarkerRule + `- level: Metadata
  userGroups: ["system:serviceaccounts"]
- level: None
`

func TestMain(m *testing.M) { os.Exit(run(m)) }

func run(m *testing.M) int {
	flag.Parse()
	dir, err := os.MkdirTemp("", "csi-sidecars-scale-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	auditArgs, log, err := audit.Setup(dir, auditPolicy)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	auditLog = log
	// Without a control plane (-short, or CSI_SIDECARS_SKIP_CONTROLPLANE=1) every test
	// skips: building the binaries would be wasted.
	if !testing.Short() && os.Getenv(controlplane.SkipEnv) != "1" {
		if binDir, err = e2e.Binaries("../../.."); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(binDir)
	}
	return kube.Main(m, controlplane.Options{APIServerArgs: auditArgs})
}
