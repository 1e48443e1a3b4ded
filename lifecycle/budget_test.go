package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/lifecycle/budget"
)

// A starting write that intake's end cut short, waiting for its token, is NotStarted and
// still wraps its error; one cancelled while intake lasts is reported.
func TestAStartingWriteCutShortByIntakeIsNotStarted(t *testing.T) {
	intake, stop := context.WithCancel(context.Background())
	ctx, cancel := StartingWork(context.Background(), intake)
	defer cancel()
	stop()
	<-ctx.Done()
	waitErr := budget.For(1, 1, nil).Wait(ctx)
	if err := IfNotStarted(ctx, fmt.Errorf("writing the record: %w", waitErr)); !NotStarted(err) || !errors.Is(err, waitErr) {
		t.Errorf("write cut short by intake's end: %v, want NotStarted, wrapping %v", err, waitErr)
	}
	own, cancelOwn := StartingWork(context.Background(), context.Background())
	cancelOwn()
	if err := IfNotStarted(own, own.Err()); NotStarted(err) {
		t.Errorf("write cancelled while intake lasts: %v, want it reported", err)
	}
}
