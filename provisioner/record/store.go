// Where provisioning records live: upstream's Provisioning events, labelled, which
// every replica watches.

package record

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Where the provisioning record is kept: Events on the claim (P14). Upstream records a
// "Provisioning" event before its CreateVolume and a "ProvisioningSucceeded" event after
// the PersistentVolume; ours are those same two events, written synchronously and
// labelled, and they carry the record: the first opens it, the second (or the undo's
// ProvisioningUndone) closes it. Three writes per provisioning, as upstream, where a record
// on the claim cost two more. The API server removes events after its --event-ttl (1 h by
// default): the record of a provisioning left unfinished outlives a crash by that long, and
// a record still open while its CreateVolume keeps being retried is written again after
// RefreshAfter.
const (
	// Label marks the events of the record; its value is DriverLabel's.
	Label = "provisioner.csi-sidecars.io/record"
	// LabelClaim holds the UID of the claim the record is about.
	LabelClaim = "provisioner.csi-sidecars.io/claim-uid"
	// AnnCloses, on an event that closes a record, lists the names of the events
	// that opened it (comma-separated).
	AnnCloses = "provisioner.csi-sidecars.io/closes"
	// AnnAlso, on an event that opens records, holds the records of further claims
	// of the event's namespace written with the first (recordBatches): a JSON list.
	AnnAlso = "provisioner.csi-sidecars.io/provisioning-also"
	// recordClaimIndex indexes the record events by the claims they are about
	// (ClaimKeys).
	recordClaimIndex = "csi-sidecars-provisioner-record-claim"
	// recordSourceIndex indexes the record events by the data sources their records
	// name (Record.Source): a source's users may be claims of any namespace.
	recordSourceIndex = "csi-sidecars-provisioner-record-source"

	ReasonProvisioning = "Provisioning"
	ReasonSucceeded    = "ProvisioningSucceeded"
)

// RefreshAfter is how old the newest event of an open record may get before a retry of
// its CreateVolume writes it again: well inside the API server's default event TTL (1 h).
const RefreshAfter = 30 * time.Minute

// DriverLabel is the value of Label for a driver: its name, which CSI makes a
// valid label value; a hash of it otherwise.
func DriverLabel(driver string) string {
	if len(validation.IsValidLabelValue(driver)) == 0 {
		return driver
	}
	sum := sha256.Sum256([]byte(driver))
	return "sha256-" + hex.EncodeToString(sum[:16])
}

// Store writes and reads the provisioning records of one driver, kept as events.
type Store struct {
	kube     kubernetes.Interface
	informer cache.SharedIndexInformer
	// own shows the record events this process created before the informer does.
	own          *lifecycle.OwnWrites[*v1.Event]
	claims       *lifecycle.OwnWrites[*v1.PersistentVolumeClaim]
	startingWork func(context.Context) (context.Context, context.CancelFunc)
	now          func() time.Time
	// writer writes the events that keep records.
	writer *eventWriter
	// decoded holds the records of the cached events, decoded.
	decoded *decodedEvents
	// lost holds the open records no event keeps.
	lost *lostRecords
}

// StoreConfig is what the store needs from the provisioner.
type StoreConfig struct {
	Kube   kubernetes.Interface
	Driver string
	// Source is the event recorder's source, that of the record's events too.
	Source v1.EventSource
	// Claims is the claim cache through this process's own writes, which include the
	// removal of an earlier version's record from a claim.
	Claims *lifecycle.OwnWrites[*v1.PersistentVolumeClaim]
	// StartingWork is the context of the writes that open a record: they end with intake
	// and wait behind the requests that finish work (P14).
	StartingWork func(context.Context) (context.Context, context.CancelFunc)
	// NotKept is told of each record the API server refused to keep (Refused): the
	// provisioning goes on without it, as upstream's does (P17). err wraps ErrNotKept.
	NotKept func(claim v1.ObjectReference, volume string, err error)
	// Lost is told of each claim whose record's events all disappeared while it was open:
	// the leader writes it again (Rewriter).
	Lost func(uid string)
}

// NewStore makes the store of cfg.Driver's records and their informer, which Start runs.
func NewStore(cfg StoreConfig) (*Store, error) {
	kube := cfg.Kube
	s := &Store{kube: kube, claims: cfg.Claims, startingWork: cfg.StartingWork, now: time.Now, decoded: &decodedEvents{}}
	driverLabel := DriverLabel(cfg.Driver)
	s.informer = coreinformers.NewFilteredEventInformer(kube, metav1.NamespaceAll, 0, cache.Indexers{
		recordClaimIndex:     func(obj any) ([]string, error) { return s.ClaimKeys(obj), nil },
		recordSourceIndex:    func(obj any) ([]string, error) { return s.sourceKeys(obj), nil },
		cache.NamespaceIndex: cache.MetaNamespaceIndexFunc,
	}, func(o *metav1.ListOptions) { o.LabelSelector = Label + "=" + driverLabel })
	if err := s.informer.SetTransform(lifecycle.TrimForCache); err != nil {
		return nil, fmt.Errorf("record events: %w", err)
	}
	// The lost records learn of deletions through OwnWrites, once it has taken each event
	// into account: on the informer itself they could see a record's event added and
	// deleted before OwnWrites saw it added, and still find it among the creations.
	s.lost = &lostRecords{decoded: s.decoded, notKept: cfg.NotKept, onLost: cfg.Lost}
	own, err := lifecycle.NewOwnCreations[*v1.Event](klog.Background(), s.informer, s.lost.handler())
	if err != nil {
		return nil, fmt.Errorf("record events: %w", err)
	}
	s.own = own
	s.writer = &eventWriter{driverLabel: driverLabel, source: cfg.Source, kube: kube, own: own, now: time.Now}
	if rl := kube.CoreV1().RESTClient().GetRateLimiter(); rl != nil && rl.QPS() > 0 {
		s.writer.linger = time.Duration(float64(time.Second) / float64(rl.QPS()))
	}
	s.lost.own, s.lost.writer = own, s.writer
	return s, nil
}

// ClaimKeys are the UIDs of the claims a record event is about: its label's, and
// those of the further records it carries.
func ClaimKeys(obj any) []string { return (*decodedEvents)(nil).claimKeys(obj) }

// ClaimKeys is the package's ClaimKeys, decoding each version of an event once.
func (s *Store) ClaimKeys(obj any) []string { return s.decoded.claimKeys(obj) }

func (d *decodedEvents) claimKeys(obj any) []string {
	ev, ok := obj.(*v1.Event)
	if !ok {
		return nil
	}
	return d.of(ev).claimKeys(ev)
}

// sourceKeys are the data sources the records an event carries name.
func (s *Store) sourceKeys(obj any) []string {
	ev, ok := obj.(*v1.Event)
	if !ok {
		return nil
	}
	dec := s.decoded.of(ev)
	var out []string
	for i := range dec.carried {
		if rec, err := s.decoded.record(dec, i); err == nil && rec.Source != "" && !slices.Contains(out, rec.Source) {
			out = append(out, rec.Source)
		}
	}
	return out
}

// Carried is one record an event carries: the claim it is about, and the record
// (AnnProvisioning's value).
type Carried struct {
	Claim  v1.ObjectReference `json:"claim"`
	Record string             `json:"record"`
}

// Start runs the informer until stop closes (every replica, P7).
func (s *Store) Start(stop <-chan struct{}) { go s.informer.Run(stop) }

// HasSynced says whether the record events are in the cache.
func (s *Store) HasSynced() bool { return s.informer.HasSynced() }

// AddEventHandler has h told of the record events.
func (s *Store) AddEventHandler(h cache.ResourceEventHandler) error {
	_, err := s.informer.AddEventHandler(h)
	return err
}

// OpenRecord is a record no event closes yet.
type OpenRecord struct {
	Record *Record
	// events are the names of the events that opened it, newest last.
	events []string
	// written is when its newest event was written.
	written time.Time
}

// Open returns the claim's open record: nil, nil for none; an error when the newest
// event that opens it cannot be read as a record. Events about another object than the
// claim of their label are ignored.
func (s *Store) Open(uid string) (*OpenRecord, error) {
	events, err := s.own.ByIndex(recordClaimIndex, uid)
	if err != nil {
		return nil, err
	}
	if r, err := s.decoded.openAmong(events, uid); r != nil || err != nil {
		return r, err
	}
	return s.lost.open(uid)
}

// OpenAmong finds the open record of the claim of uid among the record events about it.
func OpenAmong(events []*v1.Event, uid string) (*OpenRecord, error) {
	return (*decodedEvents)(nil).openAmong(events, uid)
}

func (d *decodedEvents) openAmong(events []*v1.Event, uid string) (*OpenRecord, error) {
	closed := map[string]bool{}
	for _, ev := range events {
		for name := range strings.SplitSeq(ev.Annotations[AnnCloses], ",") {
			closed[name] = true
		}
	}
	type opened struct {
		ev  *v1.Event
		dec *decodedEvent
		i   int
	}
	var opening []opened
	for _, ev := range events {
		if closed[ev.Name] {
			continue
		}
		dec := d.of(ev)
		for i, r := range dec.carried {
			if string(r.Claim.UID) == uid {
				opening = append(opening, opened{ev, dec, i})
				break
			}
		}
	}
	if len(opening) == 0 {
		return nil, nil
	}
	slices.SortFunc(opening, func(a, b opened) int {
		if c := a.ev.FirstTimestamp.Compare(b.ev.FirstTimestamp.Time); c != 0 {
			return c
		}
		return strings.Compare(a.ev.Name, b.ev.Name)
	})
	// The oldest open event is the record: a later one is the same request written again
	// (RefreshAfter), or, if a leader wrote another before seeing it, one whose volume has
	// the same name; the undo of the oldest finds that volume by its name and closes all.
	oldest, newest := opening[0], opening[len(opening)-1]
	rec, err := d.record(oldest.dec, oldest.i)
	if err != nil {
		return nil, fmt.Errorf("event %s/%s: %w", oldest.ev.Namespace, oldest.ev.Name, err)
	}
	rec.Claim = oldest.dec.carried[oldest.i].Claim
	out := &OpenRecord{Record: rec, written: newest.ev.FirstTimestamp.Time}
	for _, o := range opening {
		out.events = append(out.events, o.ev.Name)
	}
	return out, nil
}

// IsOpen is the cheap test of informer handlers: the claim has a record to finish or undo.
func (s *Store) IsOpen(uid string) bool {
	r, err := s.Open(uid)
	return r != nil || err != nil
}

// UsesSource tells whether an open record names the source of key (the source
// protection's key), and which claim's: a claim gone while its volume is undone still
// holds its source. The claim may be of another namespace than the source
// (CrossNamespaceVolumeDataSource).
func (s *Store) UsesSource(key string) (string, error) {
	events, err := s.own.ByIndex(recordSourceIndex, key)
	if err != nil {
		return "", err
	}
	seen := map[string]bool{}
	for _, ev := range events {
		for _, uid := range s.ClaimKeys(ev) {
			if seen[uid] {
				continue
			}
			seen[uid] = true
			if r, err := s.Open(uid); err == nil && r != nil && r.Record.Source == key {
				return r.Record.Claim.Namespace + "/" + r.Record.Claim.Name, nil
			}
		}
	}
	for _, uid := range s.lost.claims() {
		if r, err := s.Open(uid); err == nil && r != nil && r.Record.Source == key {
			return r.Record.Claim.Namespace + "/" + r.Record.Claim.Name, nil
		}
	}
	return "", nil
}

// close writes the event that says how the record ended (upstream's event at that point,
// or the undo's), closing every event that opened it. With no open record it is the event
// alone.
func (s *Store) close(ctx context.Context, uid string, claim v1.ObjectReference, eventType, reason, message string) error {
	ev := s.writer.event(claim, eventType, reason, message)
	ev.Labels[LabelClaim] = uid
	if r, _ := s.Open(uid); r != nil {
		ev.Annotations = map[string]string{AnnCloses: strings.Join(r.events, ",")}
	}
	return s.writer.create(ctx, ev)
}

// ClaimReference is the reference to the claim an event is about.
func ClaimReference(claim *v1.PersistentVolumeClaim) v1.ObjectReference {
	return v1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: claim.Namespace, Name: claim.Name,
		UID: claim.UID, ResourceVersion: claim.ResourceVersion}
}

// Aging tells whether the claim's open record was written long enough ago to be written
// again (RefreshAfter).
func (s *Store) Aging(uid string) bool {
	open, err := s.Open(uid)
	return err == nil && open != nil && s.now().Sub(open.written) > RefreshAfter
}

// Opening opens the claim's record (its "Provisioning" event), before the CreateVolume it
// describes. It starts work, so it ends with intake and waits behind the writes that
// finish work (StartingWork, P14). A claim that no longer wants the volume as planned is
// ErrChanged: it goes back to the queue and is decided again.
func (s *Store) Opening(ctx context.Context, claim *v1.PersistentVolumeClaim, rec *Record) error {
	switch {
	case claim.DeletionTimestamp != nil:
		return fmt.Errorf("%w: the claim is being deleted", ErrChanged)
	case claim.Annotations[volumehelpers.AnnSelectedNode] != rec.Node:
		return fmt.Errorf("%w: the claim selects another node", ErrChanged)
	}
	ctx, cancel := s.startingWork(ctx)
	defer cancel()
	err := s.writer.writeRecord(ctx, claim, rec)
	switch {
	case err == nil:
		return nil
	case Refused(err):
		// Upstream provisions where its events are refused; so does this, unprotected
		// against a crash until a retry keeps the record, and says so (P17).
		value, _ := rec.Encode()
		s.lost.refused(string(claim.UID), Carried{Claim: ClaimReference(claim), Record: value}, err)
		return nil
	}
	return lifecycle.IfNotStarted(ctx, fmt.Errorf("recording that volume %s may be created: %w", rec.Volume, err))
}

// CloseFor ends the claim's record once the volume is known (recorded by a
// PersistentVolume, or undone) with the event that says so, on ctx (Ops()). A record of an
// earlier version leaves the claim too (one update of the freshest copy this process
// knows; a conflict goes back to the queue, never to a fresh read, P14).
func (s *Store) CloseFor(ctx context.Context, uid string, claim *v1.PersistentVolumeClaim, rec *Record, eventType, reason, message string) error {
	if err := s.DropLegacy(ctx, claim); err != nil {
		return err
	}
	return s.close(ctx, uid, ClaimRef(claim, rec), eventType, reason, message)
}

// DropLegacy removes a record of an earlier version from the claim, if it has one.
func (s *Store) DropLegacy(ctx context.Context, claim *v1.PersistentVolumeClaim) error {
	if claim == nil || !Has(claim) {
		return nil
	}
	update, _ := Without(claim)
	out, err := s.kube.CoreV1().PersistentVolumeClaims(claim.Namespace).Update(ctx, update, metav1.UpdateOptions{})
	switch {
	case err == nil:
		s.claims.Wrote(out)
	case !apierrors.IsNotFound(err):
		return fmt.Errorf("removing the provisioning record from claim %s: %w", klog.KObj(claim), err)
	}
	return nil
}

// ClaimRef is the reference events about the claim use: the claim's, else (it is gone) the
// one its record's event holds.
func ClaimRef(claim *v1.PersistentVolumeClaim, rec *Record) v1.ObjectReference {
	if claim != nil {
		return ClaimReference(claim)
	}
	if rec != nil {
		return rec.Claim
	}
	return v1.ObjectReference{}
}

// OpeningEvent is the event that a store of driver, writing as source, writes to open rec
// about claim on its own (writeBatch's event for a batch of one): what a replica that died
// before closing it leaves behind, for tests that start from one.
func OpeningEvent(driver string, source v1.EventSource, claim *v1.PersistentVolumeClaim, rec *Record) (*v1.Event, error) {
	value, err := rec.Encode()
	if err != nil {
		return nil, err
	}
	w := &eventWriter{driverLabel: DriverLabel(driver), source: source, now: time.Now}
	return w.openingEvent(ClaimReference(claim), value), nil
}
