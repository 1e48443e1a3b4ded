// Records kept in memory where events are not: the API server refused the event
// (admission rate limits, quotas), or it disappeared while the record was open (an
// --event-ttl shorter than the provisioning, a user deleting events). The leader writes
// them again, with the claim queue's backoff, until an event keeps them or they are no
// longer needed.

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

// RewriteQueueName is the queue of the claims whose lost record the leader writes again
// (ours: upstream has no record).
const RewriteQueueName = "provisioner-record-rewrites"

// ErrNotKept wraps the refusal of a record the provisioning goes on without.
var ErrNotKept = errors.New("the provisioning record could not be kept")

// lostRecords are the open records no event keeps, by claim UID: refused by the API server
// when this process opened them, or whose every opening event disappeared while they were
// open (every replica notices that: its informer sees the deletion), until an event opens
// or closes them again. The leader writes them again (Store.Rewrite).
type lostRecords struct {
	mu      sync.Mutex
	byClaim map[string]lostRecord
}

// lostRecord is a record no event keeps; reported tells whether a refusal of it was
// reported already (once is enough).
type lostRecord struct {
	Carried
	reported bool
}

func (l *lostRecords) put(uid string, c Carried, reported bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byClaim == nil {
		l.byClaim = map[string]lostRecord{}
	}
	l.byClaim[uid] = lostRecord{Carried: c, reported: reported}
}

func (l *lostRecords) get(uid string) (Carried, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.byClaim[uid]
	return c.Carried, ok
}

// report tells whether a refusal of the claim's lost record is to be reported: the first.
func (l *lostRecords) report(uid string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.byClaim[uid]
	if !ok || c.reported {
		return false
	}
	c.reported = true
	l.byClaim[uid] = c
	return true
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

// watchLoss keeps the decoded events and the lost records current as the informer adds
// and deletes events: one handler, so that it sees them in order.
func (s *Store) watchLoss() error {
	_, err := s.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			// Any event about the claim opens its record again, or closes it.
			for _, uid := range s.ClaimKeys(obj) {
				s.lost.drop(uid)
			}
		},
		DeleteFunc: s.deleted,
	})
	return err
}

// deleted notices the records that the deleted event kept open and no other event does.
func (s *Store) deleted(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	ev, ok := obj.(*v1.Event)
	if !ok {
		return
	}
	defer s.decoded.forget(ev)
	for _, c := range s.decoded.of(ev).carried {
		uid := string(c.Claim.UID)
		events, err := s.own.ByIndex(recordClaimIndex, uid)
		if err != nil {
			continue
		}
		if open, err := s.decoded.openAmong(events, uid); open != nil || err != nil {
			continue
		}
		if was, err := s.decoded.openAmong(append(events, ev), uid); was == nil || err != nil {
			continue
		}
		s.lost.put(uid, c, false)
		if s.onLost != nil {
			s.onLost(uid)
		}
	}
}

// refused keeps a record the API server refused in memory, reports it, and has the leader
// write it again.
func (s *Store) refused(uid string, c Carried, err error) {
	s.lost.put(uid, c, true)
	s.notKept(c, err)
	if s.onLost != nil {
		s.onLost(uid)
	}
}

// lostOpen is the claim's lost record as an open record: written at no known time, so that
// a retry of its CreateVolume writes it again too (Aging).
func (s *Store) lostOpen(uid string) (*OpenRecord, error) {
	c, ok := s.lost.get(uid)
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

// LostVolume is the volume of the claim's lost record, if it has one.
func (s *Store) LostVolume(uid string) (string, bool) {
	r, err := s.lostOpen(uid)
	if r == nil || err != nil {
		return "", false
	}
	return r.Record.Volume, true
}

// Forget drops the claim's lost record: its volume is known now (a PersistentVolume).
func (s *Store) Forget(uid string) { s.lost.drop(uid) }

// Rewrite writes the claim's lost record again, on ctx (Ops(): it protects a call that may
// run in the driver), together with the other lost records of its namespace: they share
// events (recordBatches), so that a rate-limited API server keeps them all in a few writes.
// The first refusal of each is reported (StoreConfig.NotKept); an error is for the caller's
// queue to retry with its backoff. Until an event keeps it, a record stays in this
// process's memory, which still finishes or undoes its volume while it leads.
func (s *Store) Rewrite(ctx context.Context, uid string) error {
	c, ok := s.lost.get(uid)
	if !ok {
		return nil
	}
	others := s.lost.of(c.Claim.Namespace)
	errs := make(chan error, len(others))
	for _, other := range others {
		go func() { errs <- s.rewrite(ctx, other) }()
	}
	var err error
	for range others {
		if e := <-errs; e != nil && err == nil {
			err = e
		}
	}
	if _, still := s.lost.get(uid); !still {
		return nil
	}
	return err
}

// rewrite writes one lost record again.
func (s *Store) rewrite(ctx context.Context, uid string) error {
	c, ok := s.lost.get(uid)
	if !ok {
		return nil
	}
	err := s.writeCarried(ctx, c)
	if err == nil {
		s.lost.drop(uid)
		return nil
	}
	if Refused(err) && s.lost.report(uid) {
		s.notKept(c, err)
	}
	return err
}

// notKept reports a record the API server refused to keep.
func (s *Store) notKept(c Carried, err error) {
	if s.notKeptFunc == nil {
		return
	}
	volume := ""
	if rec, derr := Decode(c.Record); derr == nil {
		volume = rec.Volume
	}
	s.notKeptFunc(c.Claim, volume, fmt.Errorf("%w: %w", ErrNotKept, err))
}
