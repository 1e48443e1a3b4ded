// Package draintest gives the sidecars' unit tests the error of a CSI call that the
// lifecycle core refused to send because the replica is draining (P1: after SIGTERM no new
// driver call starts). A sidecar must treat such a call as "nothing happened": no failure
// event or status, no API write for it; the operation is left, with what was recorded
// before the call, to the next leader.
package draintest

import (
	"context"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// RefusedByDrain is the error of a CSI call of method (e.g. "CreateVolume") the core did
// not send because this replica is draining: Aborted to whoever reads its gRPC code, and
// one lifecycle.NotStarted recognises. It is made through the core's own API
// (lifecycle.StartingWork and lifecycle.IfNotStarted, on a context whose intake has
// ended), as the core makes it for work that intake's end cut short, so that a test
// stubbing a driver call with it sees what the sidecar would see in production. It fails
// t at once if the core no longer makes such an error.
func RefusedByDrain(t testing.TB, method string) error {
	t.Helper()
	intake, endIntake := context.WithCancel(context.Background())
	ctx, cancel := lifecycle.StartingWork(context.Background(), intake)
	defer cancel()
	endIntake()
	<-ctx.Done()
	err := lifecycle.IfNotStarted(ctx, fmt.Errorf("%s not started: this replica is shutting down; the next leader does it", method))
	if !lifecycle.NotStarted(err) || status.Code(err) != codes.Aborted {
		t.Fatalf("%v: want an Aborted error NotStarted recognises", err)
	}
	return err
}
