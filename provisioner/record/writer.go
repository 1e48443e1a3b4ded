// The events that keep the records: written one event a batch of the records that wait
// together (a group commit), weighed so that the API server accepts them.

package record

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// maxRecordBatch is how many records one event carries at most, and maxBatchBytes what
// they may weigh together, counted as the API server counts annotations (keys and values):
// three quarters of its limit on an object's annotations (256 KiB). A record is a few
// hundred bytes, but that of an immediate-binding claim of a driver with per-node topology
// lists every node (up to recordBudget of protobuf, more as JSON): in a cluster of 150
// nodes 16 to 40 KiB, so such records go five to ten to an event.
const (
	maxRecordBatch = 32
	maxBatchBytes  = 192 << 10
)

// eventWriter writes the events of one driver's records: it owns the batches of records
// waiting for their event.
type eventWriter struct {
	driverLabel string
	source      v1.EventSource
	kube        kubernetes.Interface
	// own shows the record events this process created before the informer does.
	own *lifecycle.OwnWrites[*v1.Event]
	now func() time.Time
	// batches holds the records waiting for their event.
	batches recordBatches
	// linger is how long a flush lets records gather before it takes the next batch when
	// more came in while it wrote (the budget is short): one token of the budget (1/QPS),
	// in which the PersistentVolumes of the last batch are written anyway. 0 for none.
	linger time.Duration
}

// writeRecord opens (or renews) the claim's record: the "Provisioning" event, carrying it. It
// returns once the event that carries it is written, or failed to be.
//
// Records are written as a group commit (recordBatches): while the event of one claim
// waits for the client's rate limiter or the API server, the records of other claims of
// its namespace gather, and the next event carries all of them (up to maxRecordBatch). A
// record costs a write of its own only where the budget is not short; under a backlog one
// write records many, and each claim's PersistentVolume comes sooner. The event is about
// the first claim, with upstream's message; the other claims of the batch show no
// Provisioning event of their own.
func (s *eventWriter) writeRecord(ctx context.Context, claim *v1.PersistentVolumeClaim, rec *Record) error {
	value, err := rec.Encode()
	if err != nil {
		return err
	}
	return s.write(ctx, Carried{Claim: ClaimReference(claim), Record: value})
}

// write is writeRecord of an encoded record.
func (s *eventWriter) write(ctx context.Context, c Carried) error {
	w := &waitingRecord{ctx: ctx, rec: c, done: make(chan error, 1), weight: weigh(c)}
	if s.batches.add(w) {
		go s.flush(c.Claim.Namespace)
	}
	return <-w.done
}

// waitingRecord is a record waiting for its event; done receives the outcome.
type waitingRecord struct {
	ctx  context.Context
	rec  Carried
	done chan error
	// weight is what it adds to the event's annotations (weigh).
	weight int
}

// weigh is what a record adds to an event's annotations at most: its entry in AnnAlso's
// list, escaped, which is longer than the record alone under AnnProvisioning.
func weigh(c Carried) int {
	b, err := json.Marshal(c)
	if err != nil {
		return len(c.Record) * 2
	}
	return len(b) + 1
}

// recordBatches holds, per namespace, the records waiting for their event, and whether
// a flush writes them.
type recordBatches struct {
	mu       sync.Mutex
	waiting  map[string][]*waitingRecord
	flushing map[string]bool
}

// add queues w, and tells whether the caller must start the namespace's flush.
func (b *recordBatches) add(w *waitingRecord) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.waiting == nil {
		b.waiting, b.flushing = map[string][]*waitingRecord{}, map[string]bool{}
	}
	ns := w.rec.Claim.Namespace
	b.waiting[ns] = append(b.waiting[ns], w)
	if b.flushing[ns] {
		return false
	}
	b.flushing[ns] = true
	return true
}

// backlog tells whether records of the namespace wait, and gives the first one's context.
func (b *recordBatches) backlog(ns string) (context.Context, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if q := b.waiting[ns]; len(q) > 0 {
		return q[0].ctx, true
	}
	return nil, false
}

// next takes the namespace's next batch; none ends the flush. A record whose context
// ended while it waited is answered with that and left out.
func (b *recordBatches) next(ns string) []*waitingRecord {
	b.mu.Lock()
	defer b.mu.Unlock()
	var batch []*waitingRecord
	weight := len(AnnProvisioning) + len(AnnAlso)
	rest := b.waiting[ns][:0]
	for _, w := range b.waiting[ns] {
		switch {
		case w.ctx.Err() != nil:
			w.done <- w.ctx.Err()
		case len(batch) == 0 || len(batch) < maxRecordBatch && weight+w.weight <= maxBatchBytes:
			batch = append(batch, w)
			weight += w.weight
		default:
			rest = append(rest, w)
		}
	}
	b.waiting[ns] = rest
	if len(batch) == 0 {
		delete(b.waiting, ns)
		delete(b.flushing, ns)
	}
	return batch
}

// flush writes the namespace's waiting records, one event per batch, until none wait.
// The event is written on the first record's context: all are the starting work of one
// process, which ends for all at once. When records came in while it wrote, the budget is
// short: it lingers before the next batch, and the batch is larger by what came in
// meanwhile, at no cost in the budget.
func (s *eventWriter) flush(ns string) {
	for batch := s.batches.next(ns); len(batch) > 0; batch = s.batches.next(ns) {
		s.writeBatch(batch)
		if ctx, more := s.batches.backlog(ns); more && s.linger > 0 {
			t := time.NewTimer(s.linger)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
			}
		}
	}
}

// writeBatch writes one batch's event and answers its records. A batch the API server
// refuses as too large (its limit lower than maxBatchBytes assumes) is written again in
// halves, down to a record an event.
func (s *eventWriter) writeBatch(batch []*waitingRecord) {
	err := s.writeEvent(batch)
	if len(batch) > 1 && (apierrors.IsInvalid(err) || apierrors.IsRequestEntityTooLargeError(err)) {
		klog.Background().V(2).Info("An event of provisioning records was refused, writing them in smaller events", "records", len(batch), "err", err.Error())
		half := len(batch) / 2
		s.writeBatch(batch[:half])
		s.writeBatch(batch[half:])
		return
	}
	for _, w := range batch {
		w.done <- err
	}
}

// writeEvent writes the event that carries the batch's records.
func (s *eventWriter) writeEvent(batch []*waitingRecord) error {
	first := batch[0].rec
	ev := s.openingEvent(first.Claim, first.Record)
	var err error
	if len(batch) > 1 {
		also := make([]Carried, 0, len(batch)-1)
		for _, w := range batch[1:] {
			also = append(also, w.rec)
		}
		var value []byte
		if value, err = json.Marshal(also); err == nil {
			ev.Annotations[AnnAlso] = string(value)
		}
	}
	if err != nil {
		return err
	}
	return s.create(batch[0].ctx, ev)
}

func (s *eventWriter) create(ctx context.Context, ev *v1.Event) error {
	out, err := s.kube.CoreV1().Events(ev.Namespace).Create(ctx, ev, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("writing event %s about claim %s/%s: %w", ev.Reason, ev.Namespace, ev.InvolvedObject.Name, err)
	}
	s.own.Wrote(out)
	return nil
}

// event is an event as client-go's recorder makes it (name, source, counts), labelled as
// a record event of the claim.
func (s *eventWriter) event(claim v1.ObjectReference, eventType, reason, message string) *v1.Event {
	now := metav1.NewTime(s.now())
	return &v1.Event{
		ObjectMeta: metav1.ObjectMeta{
			Name:      fmt.Sprintf("%s.%x", claim.Name, now.UnixNano()),
			Namespace: claim.Namespace,
			Labels:    map[string]string{Label: s.driverLabel, LabelClaim: string(claim.UID)},
		},
		InvolvedObject:      claim,
		Reason:              reason,
		Message:             message,
		Type:                eventType,
		Source:              s.source,
		FirstTimestamp:      now,
		LastTimestamp:       now,
		Count:               1,
		ReportingController: s.source.Component,
		ReportingInstance:   s.source.Host,
	}
}

// openingEvent is the event that opens the record value (encoded) of claim: upstream's
// "Provisioning" event, carrying it.
func (s *eventWriter) openingEvent(claim v1.ObjectReference, value string) *v1.Event {
	ev := s.event(claim, v1.EventTypeNormal, ReasonProvisioning,
		fmt.Sprintf("External provisioner is provisioning volume for claim %q", claim.Namespace+"/"+claim.Name))
	ev.Annotations = map[string]string{AnnProvisioning: value}
	return ev
}
