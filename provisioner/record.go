// The provisioning record, written before the driver is asked for
// anything, so that whoever leads next finishes or undoes what was started.

package provisioner

import (
	"context"
	"errors"
	"fmt"

	"encoding/json"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"
)

// recordPlan makes sure the plan's record is open before its CreateVolume. A record of
// the same request (a retry, or a previous leader's) stays as it is, unless it is old
// enough for its event to expire soon (recordRefresh). A record of another request stays
// open while what it asked for is unknown: the volume it may have made is undone first
// (errRecordChanged sends the claim back to be decided again).
func (c *controller) recordPlan(ctx context.Context, uid string, p *plan, existing *claimRecord) error {
	rec, err := newRecord(c.driver, p.claim.Annotations[volumehelpers.AnnSelectedNode], p.pv.secrets.provisioner, p.req)
	if err != nil {
		return err
	}
	rec.claim = claimReference(p.claim)
	if p.source.kind != sourceNone {
		rec.Source = p.source.key()
	}
	if existing != nil && existing.sameAs(rec) && !c.records.aging(uid) {
		p.rec = existing
		return nil
	}
	if existing != nil && !c.absent.is(uid, existing.Volume) {
		if err := c.undoer.undo(ctx, uid, p.claim, nil, existing, "the claim asks for its volume differently now"); err != nil {
			return err
		}
		return fmt.Errorf("%w: the volume of the earlier request was undone", errRecordChanged)
	}
	if err := c.records.opening(ctx, p.claim, rec); err != nil {
		return err
	}
	p.rec = rec
	return nil
}

// aging tells whether the claim's open record was written long enough ago to be written
// again (recordRefresh).
func (s *recordStore) aging(uid string) bool {
	open, err := s.open(uid)
	return err == nil && open != nil && s.now().Sub(open.written) > recordRefresh
}

// opening opens the claim's record (its "Provisioning" event), before the CreateVolume it
// describes. It starts work, so it ends with intake and waits behind the writes that
// finish work (StartingWork, P14). A claim that no longer wants the volume as planned is
// errRecordChanged: it goes back to the queue and is decided again.
func (s *recordStore) opening(ctx context.Context, claim *v1.PersistentVolumeClaim, rec *claimRecord) error {
	switch {
	case claim.DeletionTimestamp != nil:
		return fmt.Errorf("%w: the claim is being deleted", errRecordChanged)
	case claim.Annotations[volumehelpers.AnnSelectedNode] != rec.Node:
		return fmt.Errorf("%w: the claim selects another node", errRecordChanged)
	}
	ctx, cancel := s.startingWork(ctx)
	defer cancel()
	if err := s.write(ctx, claim, rec); err != nil {
		return lifecycle.IfNotStarted(ctx, fmt.Errorf("recording that volume %s may be created: %w", rec.Volume, err))
	}
	return nil
}

// closeFor ends the claim's record once the volume is known (recorded by a
// PersistentVolume, or undone) with the event that says so, on ctx (Ops()). A record of an
// earlier version leaves the claim too (one update of the freshest copy this process
// knows; a conflict goes back to the queue, never to a fresh read, P14).
func (s *recordStore) closeFor(ctx context.Context, uid string, claim *v1.PersistentVolumeClaim, rec *claimRecord, eventType, reason, message string) error {
	if err := s.dropLegacy(ctx, claim); err != nil {
		return err
	}
	return s.close(ctx, uid, claimRef(claim, rec), eventType, reason, message)
}

// dropLegacy removes a record of an earlier version from the claim, if it has one.
func (s *recordStore) dropLegacy(ctx context.Context, claim *v1.PersistentVolumeClaim) error {
	if claim == nil || !hasRecord(claim) {
		return nil
	}
	update, _ := withoutRecord(claim)
	out, err := s.kube.CoreV1().PersistentVolumeClaims(claim.Namespace).Update(ctx, update, metav1.UpdateOptions{})
	switch {
	case err == nil:
		s.claims.Wrote(out)
	case !apierrors.IsNotFound(err):
		return fmt.Errorf("removing the provisioning record from claim %s: %w", klog.KObj(claim), err)
	}
	return nil
}

// claimRef is the reference events about the claim use: the claim's, else (it is gone) the
// one its record's event holds.
func claimRef(claim *v1.PersistentVolumeClaim, rec *claimRecord) v1.ObjectReference {
	if claim != nil {
		return claimReference(claim)
	}
	if rec != nil {
		return rec.claim
	}
	return v1.ObjectReference{}
}

// The provisioning record: what says that a volume may exist in the driver without a
// PersistentVolume to say so (the package doc tells the whole story). It is kept in events
// on the claim (record_store.go). Records of earlier csi-sidecars versions were kept on the
// claim itself, with a finalizer holding it: such a record is still read, and dropped from
// the claim when it ends, so that an upgrade leaves no claim held.
//
// Both names are under the project's own domain on purpose. Upstream has no such record
// (its issue 486 is open and KEP-2994 was closed), and provisioner.storage.kubernetes.io is
// where upstream puts its own claim finalizers: a name there could one day be taken by an
// upstream finalizer with other rules. Under our domain upstream treats both as unknown
// and leaves them alone.
const (
	// provisioningFinalizer kept the claim while its volume might exist without a
	// PersistentVolume (records of earlier versions, on the claim).
	provisioningFinalizer = "provisioner.csi-sidecars.io/provisioning-protection"
	// annProvisioning holds the record itself (JSON, see claimRecord): on the record's
	// event, or on the claim for a record of an earlier version.
	annProvisioning = "provisioner.csi-sidecars.io/provisioning"
)

// recordBudget caps the request kept in a record. A request for an immediate-binding claim
// lists the topology of every node of the cluster, which in a large cluster would not fit
// the 256 KiB an object's annotations may hold; beyond this budget the record keeps only
// the preferred segment the driver most likely used (see recordedRequest).
const recordBudget = 32 << 10

// claimRecord is the provisioning record of one claim: which volume CreateVolume was (or is
// about to be) asked for, and how, so that the volume can be finished or undone by a
// process that remembers nothing.
type claimRecord struct {
	// Driver is the provisioner that wrote it; another driver's record is left alone.
	Driver string `json:"driver"`
	// Volume is the name CreateVolume is asked for (the PersistentVolume's name).
	Volume string `json:"volume"`
	// Node is the claim's selected node when the request was made ("" for none): a claim
	// that selects another node since no longer wants this volume.
	Node string `json:"node,omitempty"`
	// Secret is the provisioner secret the request was sent with, for an undo after the
	// StorageClass is gone; nil for none. The secret's data is never recorded.
	Secret *v1.SecretReference `json:"secret,omitempty"`
	// Request is the CreateVolumeRequest without its secrets, in protobuf JSON: an undo
	// sends it again to learn the volume's ID.
	Request json.RawMessage `json:"request"`
	// Source is the key of the claim or snapshot the volume is made from (sourceRef.key),
	// "" for none: it stays protected while the record is open, claim or no claim.
	Source string `json:"source,omitempty"`

	// req is Request decoded.
	req *csi.CreateVolumeRequest
	// claim is the claim the record is about, as its event names it (zero for a record
	// read from the claim itself, or made by this process).
	claim v1.ObjectReference
}

// newRecord makes the record of a request about to be sent.
func newRecord(driver, node string, secret *v1.SecretReference, req *csi.CreateVolumeRequest) (*claimRecord, error) {
	recorded := recordedRequest(req)
	raw, err := protojson.Marshal(recorded)
	if err != nil {
		return nil, fmt.Errorf("encoding the CreateVolume request of %s: %w", req.GetName(), err)
	}
	return &claimRecord{Driver: driver, Volume: req.GetName(), Node: node, Secret: secret, Request: raw, req: recorded}, nil
}

// recordedRequest is the request as recorded: never its secrets, and its topology cut to
// the first preferred (else requisite) segment when the whole would exceed recordBudget.
// Cutting it is safe for the undo's purpose: a driver finds an existing volume by its name,
// and one that does not exist is created wherever the segment says and deleted at once.
func recordedRequest(req *csi.CreateVolumeRequest) *csi.CreateVolumeRequest {
	out := proto.Clone(req).(*csi.CreateVolumeRequest)
	out.Secrets = nil
	if proto.Size(out) <= recordBudget || out.AccessibilityRequirements == nil {
		return out
	}
	ar := out.AccessibilityRequirements
	var first *csi.Topology
	switch {
	case len(ar.Preferred) > 0:
		first = ar.Preferred[0]
	case len(ar.Requisite) > 0:
		first = ar.Requisite[0]
	}
	out.AccessibilityRequirements = nil
	if first != nil {
		out.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{first}, Preferred: []*csi.Topology{first}}
	}
	return out
}

func (r *claimRecord) encode() (string, error) {
	b, err := json.Marshal(r)
	if err != nil {
		return "", fmt.Errorf("encoding the provisioning record of %s: %w", r.Volume, err)
	}
	return string(b), nil
}

// recordOf reads the claim's record: nil, nil when it has none; an error when the
// annotation cannot be read as one (nobody but this provisioner should write it).
func recordOf(claim *v1.PersistentVolumeClaim) (*claimRecord, error) {
	if claim == nil {
		return nil, nil
	}
	value, ok := claim.Annotations[annProvisioning]
	if !ok {
		if claim.DeletionTimestamp != nil && slices.Contains(claim.Finalizers, provisioningFinalizer) {
			// Only a hand edit gets here. A live claim gets its annotation back with its
			// next record; a deleted one cannot: nothing says which request to undo.
			return nil, fmt.Errorf("finalizer %s without annotation %s: which volume to undo is unknown", provisioningFinalizer, annProvisioning)
		}
		return nil, nil
	}
	return decodeRecord(value)
}

// decodeRecord reads a record from the value of annotation annProvisioning.
func decodeRecord(value string) (*claimRecord, error) {
	var r claimRecord
	if err := json.Unmarshal([]byte(value), &r); err != nil {
		return nil, fmt.Errorf("annotation %s is not a provisioning record: %w", annProvisioning, err)
	}
	r.req = &csi.CreateVolumeRequest{}
	if err := protojson.Unmarshal(r.Request, r.req); err != nil {
		return nil, fmt.Errorf("annotation %s holds no readable CreateVolume request: %w", annProvisioning, err)
	}
	if r.Driver == "" || r.Volume == "" || r.req.GetName() != r.Volume {
		return nil, fmt.Errorf("annotation %s names volume %q but asks for %q (driver %q)", annProvisioning, r.Volume, r.req.GetName(), r.Driver)
	}
	return &r, nil
}

// hasRecord is the cheap test informer handlers use: the claim carries a record (or half
// of one), of any driver, readable or not.
func hasRecord(claim *v1.PersistentVolumeClaim) bool {
	_, ok := claim.Annotations[annProvisioning]
	return ok || slices.Contains(claim.Finalizers, provisioningFinalizer)
}

// sameAs tells whether two records ask for the same volume the same way. Topology is left
// out: it is recomputed from the cluster's nodes, which come and go, and a driver finds an
// existing volume by its name whatever topology the retry names.
func (r *claimRecord) sameAs(o *claimRecord) bool {
	if r.Driver != o.Driver || r.Volume != o.Volume || r.Node != o.Node || !sameSecret(r.Secret, o.Secret) {
		return false
	}
	a, b := proto.Clone(r.req).(*csi.CreateVolumeRequest), proto.Clone(o.req).(*csi.CreateVolumeRequest)
	a.AccessibilityRequirements, b.AccessibilityRequirements = nil, nil
	return proto.Equal(a, b)
}

func sameSecret(a, b *v1.SecretReference) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// withRecord returns a copy of the claim carrying the record (finalizer and annotation).
func withRecord(claim *v1.PersistentVolumeClaim, value string) *v1.PersistentVolumeClaim {
	out := claim.DeepCopy()
	if out.Annotations == nil {
		out.Annotations = map[string]string{}
	}
	out.Annotations[annProvisioning] = value
	out.Finalizers, _ = withFinalizer(out.Finalizers, provisioningFinalizer, true)
	return out
}

// withoutRecord returns a copy of the claim without the record, and whether it had one.
func withoutRecord(claim *v1.PersistentVolumeClaim) (*v1.PersistentVolumeClaim, bool) {
	_, annotated := claim.Annotations[annProvisioning]
	if !annotated && !slices.Contains(claim.Finalizers, provisioningFinalizer) {
		return claim, false
	}
	out := claim.DeepCopy()
	delete(out.Annotations, annProvisioning)
	out.Finalizers, _ = withFinalizer(out.Finalizers, provisioningFinalizer, false)
	return out, true
}

// errRecordChanged: the claim changed under a record write in a way that needs a new
// decision (deleted, another node, another record); the claim is synced again.
var errRecordChanged = errors.New("the claim changed while its provisioning record was written")
