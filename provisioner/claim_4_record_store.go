// Stage 4 of a claim, where records live: upstream's Provisioning events, labelled, which
// every replica watches.

package provisioner

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// Where the provisioning record is kept: Events on the claim (P14). Upstream records a
// "Provisioning" event before its CreateVolume and a "ProvisioningSucceeded" event after
// the PersistentVolume; ours are those same two events, written synchronously and
// labelled, and they carry the record: the first opens it, the second (or the undo's
// ProvisioningUndone) closes it. Three writes per provisioning, as upstream, where a record
// on the claim cost two more. The API server removes events after its --event-ttl (1 h by
// default): the record of a provisioning left unfinished outlives a crash by that long, and
// a record still open while its CreateVolume keeps being retried is written again after
// recordRefresh.
const (
	// labelRecord marks the events of the record; its value is recordDriverLabel's.
	labelRecord = "provisioner.csi-sidecars.io/record"
	// labelRecordClaim holds the UID of the claim the record is about.
	labelRecordClaim = "provisioner.csi-sidecars.io/claim-uid"
	// annRecordCloses, on an event that closes a record, lists the names of the events
	// that opened it (comma-separated).
	annRecordCloses = "provisioner.csi-sidecars.io/closes"
	// recordClaimIndex indexes the record events by labelRecordClaim.
	recordClaimIndex = "csi-sidecars-provisioner-record-claim"

	reasonProvisioning = "Provisioning"
	reasonSucceeded    = "ProvisioningSucceeded"
)

// recordRefresh is how old the newest event of an open record may get before a retry of
// its CreateVolume writes it again: well inside the API server's default event TTL (1 h).
const recordRefresh = 30 * time.Minute

// recordDriverLabel is the value of labelRecord for a driver: its name, which CSI makes a
// valid label value; a hash of it otherwise.
func recordDriverLabel(driver string) string {
	if len(validation.IsValidLabelValue(driver)) == 0 {
		return driver
	}
	sum := sha256.Sum256([]byte(driver))
	return "sha256-" + hex.EncodeToString(sum[:16])
}

// recordStore writes and reads the provisioning records of one driver, kept as events.
type recordStore struct {
	driverLabel string
	source      v1.EventSource
	kube        kubernetes.Interface
	informer    cache.SharedIndexInformer
	// own shows the record events this process created before the informer does.
	own *lifecycle.OwnWrites[*v1.Event]
	now func() time.Time
}

func newRecordStore(kube kubernetes.Interface, driver string, source v1.EventSource) (*recordStore, error) {
	s := &recordStore{driverLabel: recordDriverLabel(driver), source: source, kube: kube, now: time.Now}
	selector := labelRecord + "=" + s.driverLabel
	s.informer = coreinformers.NewFilteredEventInformer(kube, metav1.NamespaceAll, 0, cache.Indexers{
		recordClaimIndex:     func(obj any) ([]string, error) { return recordClaimKeys(obj), nil },
		cache.NamespaceIndex: cache.MetaNamespaceIndexFunc,
	}, func(o *metav1.ListOptions) { o.LabelSelector = selector })
	if err := s.informer.SetTransform(lifecycle.TrimForCache); err != nil {
		return nil, fmt.Errorf("record events: %w", err)
	}
	own, err := lifecycle.NewOwnCreations[*v1.Event](klog.Background(), s.informer)
	if err != nil {
		return nil, fmt.Errorf("record events: %w", err)
	}
	s.own = own
	return s, nil
}

func recordClaimKeys(obj any) []string {
	if ev, ok := obj.(*v1.Event); ok && ev.Labels[labelRecordClaim] != "" {
		return []string{ev.Labels[labelRecordClaim]}
	}
	return nil
}

// start runs the informer until stop closes (every replica, P7).
func (s *recordStore) start(stop <-chan struct{}) { go s.informer.Run(stop) }

// openRecord is a record no event closes yet.
type openRecord struct {
	rec *claimRecord
	// events are the names of the events that opened it, newest last.
	events []string
	// written is when its newest event was written.
	written time.Time
}

// open returns the claim's open record: nil, nil for none; an error when the newest
// event that opens it cannot be read as a record. Events about another object than the
// claim of their label are ignored.
func (s *recordStore) open(uid string) (*openRecord, error) {
	events, err := s.own.ByIndex(recordClaimIndex, uid)
	if err != nil {
		return nil, err
	}
	return openAmong(events, uid)
}

// openAmong finds the open record of the claim of uid among the record events about it.
func openAmong(events []*v1.Event, uid string) (*openRecord, error) {
	closed := map[string]bool{}
	for _, ev := range events {
		for name := range strings.SplitSeq(ev.Annotations[annRecordCloses], ",") {
			closed[name] = true
		}
	}
	var opening []*v1.Event
	for _, ev := range events {
		if _, ok := ev.Annotations[annProvisioning]; ok && !closed[ev.Name] && string(ev.InvolvedObject.UID) == uid {
			opening = append(opening, ev)
		}
	}
	if len(opening) == 0 {
		return nil, nil
	}
	slices.SortFunc(opening, func(a, b *v1.Event) int {
		if c := a.FirstTimestamp.Compare(b.FirstTimestamp.Time); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	// The oldest open event is the record: a later one is the same request written again
	// (recordRefresh), or, if a leader wrote another before seeing it, one whose volume has
	// the same name; the undo of the oldest finds that volume by its name and closes all.
	oldest, newest := opening[0], opening[len(opening)-1]
	rec, err := decodeRecord(oldest.Annotations[annProvisioning])
	if err != nil {
		return nil, fmt.Errorf("event %s/%s: %w", oldest.Namespace, oldest.Name, err)
	}
	rec.claim = oldest.InvolvedObject
	out := &openRecord{rec: rec, written: newest.FirstTimestamp.Time}
	for _, ev := range opening {
		out.events = append(out.events, ev.Name)
	}
	return out, nil
}

// isOpen is the cheap test of informer handlers: the claim has a record to finish or undo.
func (s *recordStore) isOpen(uid string) bool {
	r, err := s.open(uid)
	return r != nil || err != nil
}

// usesSource tells whether an open record of a claim in the source's namespace names it,
// and which claim's: a claim gone while its volume is undone still holds its source.
func (s *recordStore) usesSource(ref sourceRef) (string, error) {
	events, err := s.own.ByIndex(cache.NamespaceIndex, ref.namespace)
	if err != nil {
		return "", err
	}
	seen := map[string]bool{}
	for _, ev := range events {
		uid := ev.Labels[labelRecordClaim]
		if uid == "" || seen[uid] {
			continue
		}
		seen[uid] = true
		if r, err := s.open(uid); err == nil && r != nil && r.rec.Source == ref.key() {
			return r.rec.claim.Namespace + "/" + r.rec.claim.Name, nil
		}
	}
	return "", nil
}

// write opens (or renews) the claim's record: the "Provisioning" event, carrying it.
func (s *recordStore) write(ctx context.Context, claim *v1.PersistentVolumeClaim, rec *claimRecord) error {
	value, err := rec.encode()
	if err != nil {
		return err
	}
	ev := s.event(claimReference(claim), v1.EventTypeNormal, reasonProvisioning,
		fmt.Sprintf("External provisioner is provisioning volume for claim %q", claim.Namespace+"/"+claim.Name))
	ev.Annotations = map[string]string{annProvisioning: value}
	return s.create(ctx, ev)
}

// close writes the event that says how the record ended (upstream's event at that point,
// or the undo's), closing every event that opened it. With no open record it is the event
// alone.
func (s *recordStore) close(ctx context.Context, uid string, claim v1.ObjectReference, eventType, reason, message string) error {
	ev := s.event(claim, eventType, reason, message)
	ev.Labels[labelRecordClaim] = uid
	if r, _ := s.open(uid); r != nil {
		ev.Annotations = map[string]string{annRecordCloses: strings.Join(r.events, ",")}
	}
	return s.create(ctx, ev)
}

func (s *recordStore) create(ctx context.Context, ev *v1.Event) error {
	out, err := s.kube.CoreV1().Events(ev.Namespace).Create(ctx, ev, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("writing event %s about claim %s/%s: %w", ev.Reason, ev.Namespace, ev.InvolvedObject.Name, err)
	}
	s.own.Wrote(out)
	return nil
}

// event is an event as client-go's recorder makes it (name, source, counts), labelled as
// a record event of the claim.
func (s *recordStore) event(claim v1.ObjectReference, eventType, reason, message string) *v1.Event {
	now := metav1.NewTime(s.now())
	return &v1.Event{
		ObjectMeta: metav1.ObjectMeta{
			Name:      fmt.Sprintf("%s.%x", claim.Name, now.UnixNano()),
			Namespace: claim.Namespace,
			Labels:    map[string]string{labelRecord: s.driverLabel, labelRecordClaim: string(claim.UID)},
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

// claimReference is the reference to the claim an event is about.
func claimReference(claim *v1.PersistentVolumeClaim) v1.ObjectReference {
	return v1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: claim.Namespace, Name: claim.Name,
		UID: claim.UID, ResourceVersion: claim.ResourceVersion}
}
