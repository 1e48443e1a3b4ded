package lifecycle

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csi-sidecars/csi-sidecars/lifecycle/budget"
)

// StartingWork returns a context for the API writes that start new work, before the driver
// is called (a record, a finalizer put on first): it ends when intake ends, so such a write
// never stretches a drain (P14: the work is left, with what was recorded, to the next
// leader), and its requests wait for a token behind every request that finishes work.
// Cancel it when the write is done. See budget.StartingWork.
func StartingWork(ctx, intake context.Context) (context.Context, context.CancelFunc) {
	return budget.StartingWork(ctx, intake)
}

// Deferrable returns a context for API writes that nothing waits for and that the next
// leader would redo (an event closing a record that a PersistentVolume already
// supersedes): they get a token only when no other request of the sidecar waits, and end
// with intake (IfNotStarted) so that they never stretch a drain. Cancel it when done. See
// budget.Deferrable.
func Deferrable(ctx, intake context.Context) (context.Context, context.CancelFunc) {
	return budget.Deferrable(ctx, intake)
}

// IfNotStarted returns err, as one NotStarted recognises when ctx (a StartingWork context)
// ended with intake: the write that would have started the work did not happen, or its
// answer was not waited for, and the sidecar reports nothing about it.
func IfNotStarted(ctx context.Context, err error) error {
	if err == nil || !budget.EndedWithIntake(ctx) || NotStarted(err) {
		return err
	}
	return notStartedError{st: status.New(codes.Aborted, err.Error()), err: err}
}
