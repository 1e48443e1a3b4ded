package provisioner

import (
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// createOutcome is what a failed CreateVolume means for the volume.
type createOutcome int

const (
	// createFinal: the driver is not creating the volume; retry later with backoff, or
	// give up when the claim goes away.
	createFinal createOutcome = iota
	// createInBackground: the volume may exist or be in creation. Keep calling
	// CreateVolume with the same name until the driver answers for good, even if the claim
	// is deleted meanwhile: giving up could leak the volume.
	createInBackground
	// createReschedule: final, and the scheduler should pick another node (the selected
	// node is removed from the claim).
	createReschedule
)

func (o createOutcome) String() string {
	switch o {
	case createFinal:
		return "final"
	case createInBackground:
		return "in background"
	case createReschedule:
		return "reschedule"
	}
	return "unknown"
}

// classifyCreateError tells what a CreateVolume error means, as upstream. mayReschedule
// is true when the driver has topology and a node was selected: only then can another node
// help.
func classifyCreateError(err error, mayReschedule bool) createOutcome {
	st, ok := status.FromError(err)
	if !ok {
		// Not from gRPC: the call may not even have been sent, but nothing says so for sure.
		return createInBackground
	}
	switch st.Code() {
	case codes.ResourceExhausted:
		// CSI: no room in the requested topology; not in progress.
		if mayReschedule {
			return createReschedule
		}
		return createFinal
	case codes.Canceled, codes.DeadlineExceeded, codes.Unavailable, codes.Aborted:
		// The call was cut off or the driver is still working on this name.
		return createInBackground
	}
	return createFinal
}
