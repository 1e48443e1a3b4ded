// CreateVolume, and what its answer means for the claim; the plans
// that may be running in the driver (inFlight).

package provisioner

import (
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// inFlight holds, by claim UID, the plan of every CreateVolume that is about to run or may
// still be running in the driver: it is retried as it is, claim or no claim, until the
// driver answers for good. It is also what keeps the plan's source protected while the
// claim may be gone (sourceUser).
type inFlight struct {
	mu    sync.Mutex
	plans map[string]*plan
}

func (f *inFlight) get(uid string) *plan {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.plans[uid]
}

// set makes p the claim's plan in flight; nil: none.
func (f *inFlight) set(uid string, p *plan) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p == nil {
		delete(f.plans, uid)
		return
	}
	if f.plans == nil {
		f.plans = map[string]*plan{}
	}
	f.plans[uid] = p
}

// using names the claim of a plan in flight made from ref, "" for none.
func (f *inFlight) using(ref request.SourceRef) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, p := range f.plans {
		if p.source == ref {
			return klog.KObj(p.claim).String()
		}
	}
	return ""
}

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
