// The provisioning record, written before the driver is asked for
// anything, so that whoever leads next finishes or undoes what was started.

package record

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	v1 "k8s.io/api/core/v1"

	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// The provisioning record: what says that a volume may exist in the driver without a
// PersistentVolume to say so (the package doc tells the whole story). It is kept in events
// on the claim (store.go). Records of earlier csi-sidecars versions were kept on the
// claim itself, with a finalizer holding it: such a record is still read, and dropped from
// the claim when it ends, so that an upgrade leaves no claim held.
//
// Both names are under the project's own domain on purpose. Upstream has no such record
// (its issue 486 is open and KEP-2994 was closed), and provisioner.storage.kubernetes.io is
// where upstream puts its own claim finalizers: a name there could one day be taken by an
// upstream finalizer with other rules. Under our domain upstream treats both as unknown
// and leaves them alone.
const (
	// ProvisioningFinalizer kept the claim while its volume might exist without a
	// PersistentVolume (records of earlier versions, on the claim).
	ProvisioningFinalizer = "provisioner.csi-sidecars.io/provisioning-protection"
	// AnnProvisioning holds the record itself (JSON, see Record): on the record's
	// event, or on the claim for a record of an earlier version.
	AnnProvisioning = "provisioner.csi-sidecars.io/provisioning"
)

// recordBudget caps the request kept in a record. A request for an immediate-binding claim
// lists the topology of every node of the cluster, which in a large cluster would not fit
// the 256 KiB an object's annotations may hold; beyond this budget the record keeps only
// the preferred segment the driver most likely used (see recordedRequest).
const recordBudget = 32 << 10

// Record is the provisioning record of one claim: which volume CreateVolume was (or is
// about to be) asked for, and how, so that the volume can be finished or undone by a
// process that remembers nothing.
type Record struct {
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
	// Source is the key of the claim or snapshot the volume is made from (request.SourceRef.Key),
	// "" for none: it stays protected while the record is open, claim or no claim.
	Source string `json:"source,omitempty"`

	// req is Request decoded.
	req *csi.CreateVolumeRequest
	// Claim is the claim the record is about, as its event names it (zero for a record
	// read from the claim itself, or made by this process).
	Claim v1.ObjectReference `json:"-"`
}

// New makes the record of a request about to be sent.
func New(driver, node string, secret *v1.SecretReference, req *csi.CreateVolumeRequest) (*Record, error) {
	recorded := recordedRequest(req)
	raw, err := protojson.Marshal(recorded)
	if err != nil {
		return nil, fmt.Errorf("encoding the CreateVolume request of %s: %w", req.GetName(), err)
	}
	return &Record{Driver: driver, Volume: req.GetName(), Node: node, Secret: secret, Request: raw, req: recorded}, nil
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

func (r *Record) Encode() (string, error) {
	b, err := json.Marshal(r)
	if err != nil {
		return "", fmt.Errorf("encoding the provisioning record of %s: %w", r.Volume, err)
	}
	return string(b), nil
}

// Of reads the claim's record: nil, nil when it has none; an error when the
// annotation cannot be read as one (nobody but this provisioner should write it).
func Of(claim *v1.PersistentVolumeClaim) (*Record, error) {
	if claim == nil {
		return nil, nil
	}
	value, ok := claim.Annotations[AnnProvisioning]
	if !ok {
		if claim.DeletionTimestamp != nil && slices.Contains(claim.Finalizers, ProvisioningFinalizer) {
			// Only a hand edit gets here. A live claim gets its annotation back with its
			// next record; a deleted one cannot: nothing says which request to undo.
			return nil, fmt.Errorf("finalizer %s without annotation %s: which volume to undo is unknown", ProvisioningFinalizer, AnnProvisioning)
		}
		return nil, nil
	}
	return Decode(value)
}

// CreateVolumeRequest is the recorded request, without its secrets.
func (r *Record) CreateVolumeRequest() *csi.CreateVolumeRequest { return r.req }

// Decode reads a record from the value of annotation AnnProvisioning.
func Decode(value string) (*Record, error) {
	var r Record
	if err := json.Unmarshal([]byte(value), &r); err != nil {
		return nil, fmt.Errorf("annotation %s is not a provisioning record: %w", AnnProvisioning, err)
	}
	r.req = &csi.CreateVolumeRequest{}
	if err := protojson.Unmarshal(r.Request, r.req); err != nil {
		return nil, fmt.Errorf("annotation %s holds no readable CreateVolume request: %w", AnnProvisioning, err)
	}
	if r.Driver == "" || r.Volume == "" || r.req.GetName() != r.Volume {
		return nil, fmt.Errorf("annotation %s names volume %q but asks for %q (driver %q)", AnnProvisioning, r.Volume, r.req.GetName(), r.Driver)
	}
	return &r, nil
}

// Has is the cheap test informer handlers use: the claim carries a record (or half
// of one), of any driver, readable or not.
func Has(claim *v1.PersistentVolumeClaim) bool {
	_, ok := claim.Annotations[AnnProvisioning]
	return ok || slices.Contains(claim.Finalizers, ProvisioningFinalizer)
}

// SameAs tells whether two records ask for the same volume the same way. Topology is left
// out: it is recomputed from the cluster's nodes, which come and go, and a driver finds an
// existing volume by its name whatever topology the retry names.
func (r *Record) SameAs(o *Record) bool {
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

// With returns a copy of the claim carrying the record (finalizer and annotation).
func With(claim *v1.PersistentVolumeClaim, value string) *v1.PersistentVolumeClaim {
	out := claim.DeepCopy()
	if out.Annotations == nil {
		out.Annotations = map[string]string{}
	}
	out.Annotations[AnnProvisioning] = value
	out.Finalizers, _ = request.WithFinalizer(out.Finalizers, ProvisioningFinalizer, true)
	return out
}

// Without returns a copy of the claim without the record, and whether it had one.
func Without(claim *v1.PersistentVolumeClaim) (*v1.PersistentVolumeClaim, bool) {
	_, annotated := claim.Annotations[AnnProvisioning]
	if !annotated && !slices.Contains(claim.Finalizers, ProvisioningFinalizer) {
		return claim, false
	}
	out := claim.DeepCopy()
	delete(out.Annotations, AnnProvisioning)
	out.Finalizers, _ = request.WithFinalizer(out.Finalizers, ProvisioningFinalizer, false)
	return out, true
}

// ErrChanged: the claim changed under a record write in a way that needs a new
// decision (deleted, another node, another record); the claim is synced again.
var ErrChanged = errors.New("the claim changed while its provisioning record was written")
