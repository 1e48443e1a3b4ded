// Records kept in memory where events are not: the API server refused the event
// (admission rate limits, policies, RBAC), or it disappeared while the record was open (an
// --event-ttl shorter than the provisioning, a user deleting events). The leader writes
// them again (rewrite.go) until an event keeps them or they are no longer needed.

package record

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/cache"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Refused tells whether err is the API server refusing to keep an event, for good or for a
// while: a rate limit (EventRateLimit admission, API priority and fairness), a quota, an
// admission webhook, RBAC, validation. Upstream writes its events fire-and-forget and
// provisions under all of these (P17): so does the store, without the record, and says so.
// An unreachable or failing API server is no refusal: the PersistentVolume could not be
// saved either, and the write is retried.
func Refused(err error) bool {
	return apierrors.IsTooManyRequests(err) || apierrors.IsForbidden(err) || apierrors.IsInvalid(err) ||
		apierrors.IsRequestEntityTooLargeError(err) || apierrors.IsBadRequest(err) || apierrors.IsAlreadyExists(err)
}

// ErrNotKept wraps the refusal of a record the provisioning goes on without.
var ErrNotKept = errors.New("the provisioning record could not be kept")

// lostRecords are the open records no event keeps, by claim UID: refused by the API server
// when this process opened them, or whose every opening event disappeared while they were
// open (every replica notices that: its informer sees the deletion), until an event opens
// or closes them again. It owns that memory; the leader's Rewriter writes them again.
type lostRecords struct {
	own     *lifecycle.OwnWrites[*v1.Event]
	decoded *decodedEvents
	writer  *eventWriter
	// notKept is told of the first refusal of each record (StoreConfig.NotKept); onLost of
	// each record lost (StoreConfig.Lost).
	notKept func(claim v1.ObjectReference, volume string, err error)
	onLost  func(uid string)

	mu      sync.Mutex
	byClaim map[string]lostRecord
}

// lostRecord is a record no event keeps; reported tells whether a refusal of it was
// reported already (once is enough).
type lostRecord struct {
	Carried
	reported bool
}

// handler keeps the decoded events and the lost records current as the informer adds and
// deletes events: one handler, so that it sees them in order.
func (l *lostRecords) handler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			// Any event about the claim opens its record again, or closes it.
			for _, uid := range l.decoded.claimKeys(obj) {
				l.drop(uid)
			}
		},
		DeleteFunc: l.deleted,
	}
}

// deleted notices the records that the deleted event kept open and no other event does.
func (l *lostRecords) deleted(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	ev, ok := obj.(*v1.Event)
	if !ok {
		return
	}
	defer l.decoded.forget(ev)
	for _, c := range l.decoded.of(ev).carried {
		uid := string(c.Claim.UID)
		events, err := l.own.ByIndex(recordClaimIndex, uid)
		if err != nil {
			continue
		}
		if open, err := l.decoded.openAmong(events, uid); open != nil || err != nil {
			continue
		}
		if was, err := l.decoded.openAmong(append(events, ev), uid); was == nil || err != nil {
			continue
		}
		l.put(uid, c, false)
	}
}

// refused keeps a record the API server refused in memory, reports it, and has the leader
// write it again.
func (l *lostRecords) refused(uid string, c Carried, err error) {
	l.put(uid, c, false)
	l.report(uid, c, err)
}

// put keeps the claim's record c, and tells onLost.
func (l *lostRecords) put(uid string, c Carried, reported bool) {
	l.mu.Lock()
	if l.byClaim == nil {
		l.byClaim = map[string]lostRecord{}
	}
	l.byClaim[uid] = lostRecord{Carried: c, reported: reported}
	l.mu.Unlock()
	if l.onLost != nil {
		l.onLost(uid)
	}
}

func (l *lostRecords) get(uid string) (Carried, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.byClaim[uid]
	return c.Carried, ok
}

// report tells notKept of a refusal of the claim's lost record, the first one only.
func (l *lostRecords) report(uid string, c Carried, err error) {
	l.mu.Lock()
	lost, ok := l.byClaim[uid]
	first := ok && !lost.reported
	if first {
		lost.reported = true
		l.byClaim[uid] = lost
	}
	l.mu.Unlock()
	if !first || l.notKept == nil {
		return
	}
	volume := ""
	if rec, derr := Decode(c.Record); derr == nil {
		volume = rec.Volume
	}
	l.notKept(c.Claim, volume, fmt.Errorf("%w: %w", ErrNotKept, err))
}

// claims lists the claims with a lost record, of every namespace: a claim's source may
// be in another namespace (CrossNamespaceVolumeDataSource).
func (l *lostRecords) claims() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Collect(maps.Keys(l.byClaim))
}

// of lists the claims of the namespace with a lost record.
func (l *lostRecords) of(namespace string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for uid, c := range l.byClaim {
		if c.Claim.Namespace == namespace {
			out = append(out, uid)
		}
	}
	return out
}

func (l *lostRecords) drop(uid string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.byClaim, uid)
}

// open is the claim's lost record as an open record: written at no known time, so that a
// retry of its CreateVolume writes it again too (Store.Aging).
func (l *lostRecords) open(uid string) (*OpenRecord, error) {
	c, ok := l.get(uid)
	if !ok {
		return nil, nil
	}
	rec, err := Decode(c.Record)
	if err != nil {
		return nil, err
	}
	rec.Claim = c.Claim
	return &OpenRecord{Record: rec}, nil
}

// rewrite writes the claim's lost record again, on ctx, together with the other lost
// records of its namespace: they share events (recordBatches), so that a rate-limited API
// server keeps them all in a few writes. The first refusal of each is reported; an error
// is for the caller's queue to retry with its backoff.
func (l *lostRecords) rewrite(ctx context.Context, uid string) error {
	c, ok := l.get(uid)
	if !ok {
		return nil
	}
	others := l.of(c.Claim.Namespace)
	errs := make(chan error, len(others))
	for _, other := range others {
		go func() { errs <- l.rewriteOne(ctx, other) }()
	}
	var err error
	for range others {
		if e := <-errs; e != nil && err == nil {
			err = e
		}
	}
	if _, still := l.get(uid); !still {
		return nil
	}
	return err
}

// rewriteOne writes one lost record again.
func (l *lostRecords) rewriteOne(ctx context.Context, uid string) error {
	c, ok := l.get(uid)
	if !ok {
		return nil
	}
	err := l.writer.write(ctx, c)
	switch {
	case err == nil:
		l.drop(uid)
	case Refused(err):
		l.report(uid, c, err)
	}
	return err
}
