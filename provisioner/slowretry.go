package provisioner

import (
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/types"
)

// Upstream's slow retry of infeasible requests (sig-storage-lib-external-provisioner's
// slow set): a CreateVolume the driver refused with InvalidArgument says the request
// itself is wrong, and the same request would be refused again, so the claim waits
// --retry-interval-max before its next CreateVolume instead of the usual backoff, unless
// its StorageClass is replaced meanwhile (another UID: the request may differ now). The
// claim's other work (a provisioning record to finish or undo) does not wait.
//
// Not csi-lib-utils' slowset: its Add keeps an entry already there, even expired, until
// its Run goroutine (a 100 ms ticker) drops it, and it reads the clock itself; here a lapsed
// or stale entry goes when read, a new infeasible answer replaces it, and no goroutine runs.

// isInfeasible tells whether a CreateVolume error is upstream's infeasible error.
func isInfeasible(err error) bool {
	st, ok := status.FromError(err)
	return ok && st.Code() == codes.InvalidArgument
}

// slowRetries remembers, by claim UID, the infeasible CreateVolume of a claim: when, and
// the UID of the StorageClass it was made from. Memory only, as upstream's: a new leader
// tries once more.
type slowRetries struct {
	mu sync.Mutex
	m  map[string]slowRetry
}

type slowRetry struct {
	at    time.Time
	class types.UID
}

func (s *slowRetries) mark(uid string, class types.UID, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]slowRetry{}
	}
	s.m[uid] = slowRetry{at: now, class: class}
}

func (s *slowRetries) forget(uid string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, uid)
}

// remaining is how long the claim must still wait before its next CreateVolume: 0 when it
// has no infeasible request, the window has passed, or the class was replaced (the memory
// then goes).
func (s *slowRetries) remaining(uid string, class types.UID, window time.Duration, now time.Time) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.m[uid]
	if !ok {
		return 0
	}
	left := window - now.Sub(r.at)
	if r.class != class || left <= 0 {
		delete(s.m, uid)
		return 0
	}
	return left
}
