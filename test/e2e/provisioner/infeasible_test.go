package provisioner

import (
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// Upstream's slow retry of an infeasible request: after CreateVolume answers
// InvalidArgument, the claim's next CreateVolume comes --retry-interval-max (2s here)
// later, not after --retry-interval-start (100ms), and the claim's event says the retries
// are delayed; then it is provisioned.
func TestAnInfeasibleCreateVolumeIsRetriedSlowly(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	fast := s.createClass("fast", nil)
	r := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	r.WaitReady(t)
	if err := s.Driver.InjectFault(testdriver.Fault{Method: testdriver.MethodCreateVolume, Code: codes.InvalidArgument, Times: 1}); err != nil {
		t.Fatal(err)
	}
	c := s.createClaim("data", fast.Name, "")
	s.WaitUntil("the PersistentVolume", func() bool { return len(s.pvsByClaim()[c.UID]) == 1 })
	calls := createCalls(s.Driver.Journal())
	if len(calls) != 2 || calls[0].Code != "InvalidArgument" || calls[1].Code != "OK" {
		t.Fatalf("CreateVolume calls %+v, want InvalidArgument, then OK", calls)
	}
	gap := calls[1].Start.Sub(calls[0].End)
	t.Logf("FIGURE infeasible CreateVolume retried after %v", gap)
	if gap < 1900*time.Millisecond {
		t.Errorf("retried %v after the infeasible request, want about --retry-interval-max (2s)", gap)
	}
	if !slices.ContainsFunc(s.events("data", "ProvisioningFailed"), func(m string) bool { return strings.Contains(m, "Retries will be delayed") }) {
		t.Errorf("events %v, want one saying the retries are delayed", s.events("data", "ProvisioningFailed"))
	}
}
