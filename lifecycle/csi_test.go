package lifecycle

import (
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Calls that may still run in the driver are not final; a driver's refusal is.
func TestIsFinalError(t *testing.T) {
	for code, want := range map[codes.Code]bool{
		codes.Canceled: false, codes.DeadlineExceeded: false, codes.Unavailable: false,
		codes.ResourceExhausted: false, codes.Aborted: false,
		codes.NotFound: true, codes.InvalidArgument: true, codes.Internal: true,
		codes.FailedPrecondition: true, codes.AlreadyExists: true, codes.Unknown: true,
	} {
		if got := IsFinalError(status.Error(code, "x")); got != want {
			t.Errorf("%v: final %v, want %v", code, got, want)
		}
	}
	if IsFinalError(errors.New("not from the driver")) {
		t.Error("a non-gRPC error counts as final")
	}
}
