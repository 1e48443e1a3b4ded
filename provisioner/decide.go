// Deciding about a claim: does it want a volume of this driver, and what does an open
// provisioning record of it ask for (finish, drop, undo)? Plain functions over facts.

package provisioner

import (
	"fmt"
	"strings"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/types"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/provisioner/record"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// mayNeedVolume is the cheap test informer handlers use: the claim is unbound and asks
// the driver for its volume.
func mayNeedVolume(claim *v1.PersistentVolumeClaim, names request.DriverNames) bool {
	return claim.Spec.VolumeName == "" && names.ClaimNamesDriver(claim)
}

// wantsVolume decides whether the driver should provision a volume for the claim now;
// when not, why (for the log).
func wantsVolume(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, names request.DriverNames) (bool, string) {
	switch {
	case claim.Spec.VolumeName != "":
		return false, "claim is bound"
	case !names.ClaimNamesDriver(claim):
		return false, "claim names another provisioner"
	case claim.DeletionTimestamp != nil:
		return false, "claim is being deleted"
	case class == nil:
		return false, "claim has no StorageClass"
	case !names.ClassOfDriver(class):
		return false, fmt.Sprintf("StorageClass %s names provisioner %s", class.Name, class.Provisioner)
	case request.WaitsForFirstConsumer(class) && claim.Annotations[volumehelpers.AnnSelectedNode] == "":
		// The scheduler sets the node when a pod uses the claim; the provisioner removes it
		// again to ask for another node.
		return false, "waiting for the scheduler to select a node"
	}
	return true, ""
}

// dataSourceKind is the kind of the claim's data source ("" for none), for metrics and the
// data source check.
func dataSourceKind(claim *v1.PersistentVolumeClaim) string {
	if ds := claim.Spec.DataSourceRef; ds != nil {
		return ds.Kind
	}
	if ds := claim.Spec.DataSource; ds != nil {
		return ds.Kind
	}
	return ""
}

// volumeOfClaim tells whether a recorded volume name can be the claim's: <prefix>-<UID>,
// or <prefix>-<the UID without dashes, cut>, as request.VolumeName makes them under any
// flags. The claim's owner can edit its annotations; this keeps an edited record from
// making the provisioner undo, that is delete, the volume of another claim. A cut UID
// must keep at least minCut characters (the configured length when shorter than 8: its
// names collide anyway).
func volumeOfClaim(name string, uid types.UID, minCut int) bool {
	if uid == "" {
		return false
	}
	if prefix, ok := strings.CutSuffix(name, "-"+string(uid)); ok && prefix != "" {
		return true
	}
	i := strings.LastIndexByte(name, '-')
	if i < 1 {
		return false
	}
	cut := name[i+1:]
	compact := strings.ReplaceAll(string(uid), "-", "")
	return len(cut) >= max(1, min(minCut, 8)) && strings.HasPrefix(compact, cut)
}

// recordAction is what to do about a claim's record.
type recordAction int

const (
	// recordNone: no record of a volume that may exist; provision as usual.
	recordNone recordAction = iota
	// recordFinish: the claim still wants the volume: CreateVolume (idempotent by name),
	// then the PersistentVolume, then the record goes.
	recordFinish
	// recordDrop: a PersistentVolume records the volume; the record goes.
	recordDrop
	// recordUndo: the claim no longer wants the volume: learn its ID (CreateVolume with
	// the recorded request), DeleteVolume, then the record goes.
	recordUndo
	// recordSkip: another driver's record, or another node's in a node deployment.
	recordSkip
	// recordUntrusted: a record this provisioner must not act on; it is reported and left
	// for an administrator.
	recordUntrusted
)

func (a recordAction) String() string {
	return [...]string{"none", "finish", "drop", "undo", "skip", "untrusted"}[a]
}

// recordFacts is what decideRecord decides from.
type recordFacts struct {
	// claim is nil when it is gone.
	claim *v1.PersistentVolumeClaim
	// rec is the record: this process's own when it has one, else the claim's; recErr
	// when the claim's cannot be read.
	rec    *record.Record
	recErr error
	// fromMemory: rec is this process's own, not read from an event or the claim.
	fromMemory bool
	// uid is the claim's UID (the queue's key), whether or not the claim is still there.
	uid    types.UID
	driver string
	// inTree is the in-tree plugin the driver replaces, "" for none.
	inTree string
	// node is the node of a node deployment, "" otherwise.
	node string
	// wantName is the claim's volume name under the current flags, "" if none can be made.
	wantName string
	// minCut is --volume-name-uuid-length (-1: the whole UID).
	minCut int
	// pvExists: a PersistentVolume of the recorded volume's name exists.
	pvExists bool
}

// decideRecord decides what a record asks for, and why (for events and the log).
func decideRecord(f recordFacts) (recordAction, string) {
	if f.recErr != nil {
		return recordUntrusted, f.recErr.Error()
	}
	r, claim := f.rec, f.claim
	switch {
	case r == nil:
		return recordNone, ""
	case r.Driver != f.driver:
		return recordSkip, fmt.Sprintf("the record is driver %s's", r.Driver)
	case f.node != "" && r.Node != f.node:
		return recordSkip, fmt.Sprintf("the record is node %s's", r.Node)
	case !f.fromMemory && !volumeOfClaim(r.Volume, f.claimUID(), cutLength(f.minCut)):
		return recordUntrusted, fmt.Sprintf("annotation %s names volume %q, which is not made from the claim's UID %s", record.AnnProvisioning, r.Volume, f.claimUID())
	case f.pvExists:
		// Whoever's it is (a cut UID can collide), the name is recorded: never delete it.
		return recordDrop, fmt.Sprintf("PersistentVolume %s records the volume", r.Volume)
	case claim == nil:
		return recordUndo, "the claim is gone"
	case claim.DeletionTimestamp != nil:
		return recordUndo, "the claim is being deleted"
	case !(request.DriverNames{Driver: f.driver, InTree: f.inTree}).ClaimNamesDriver(claim):
		return recordUndo, fmt.Sprintf("the claim names provisioner %q now", request.ClaimProvisioner(claim))
	case claim.Spec.VolumeName != "" && claim.Spec.VolumeName != r.Volume:
		return recordUndo, fmt.Sprintf("the claim is bound to PersistentVolume %s", claim.Spec.VolumeName)
	}
	if node := claim.Annotations[volumehelpers.AnnSelectedNode]; node != r.Node {
		switch {
		case r.Node == "":
			return recordUndo, fmt.Sprintf("the claim selects node %s since", node)
		case node == "":
			return recordUndo, fmt.Sprintf("the claim was rescheduled away from node %s", r.Node)
		}
		return recordUndo, fmt.Sprintf("the claim was rescheduled from node %s to %s", r.Node, node)
	}
	if f.wantName != "" && f.wantName != r.Volume {
		return recordUndo, fmt.Sprintf("the claim's volume is named %s under the current flags", f.wantName)
	}
	return recordFinish, ""
}

// claimUID is the UID the record is about.
func (f recordFacts) claimUID() types.UID {
	if f.uid == "" && f.claim != nil {
		return f.claim.UID
	}
	return f.uid
}

func cutLength(uuidLength int) int {
	if uuidLength < 0 {
		return 8
	}
	return uuidLength
}

// classOf returns the claim's StorageClass from the cache; nil, nil for a claim without
// one.
func classOf(classes storagelisters.StorageClassLister, claim *v1.PersistentVolumeClaim) (*storagev1.StorageClass, error) {
	name := volumehelpers.GetPersistentVolumeClaimClass(claim)
	if name == "" {
		return nil, nil
	}
	class, err := classes.Get(name)
	if err != nil {
		// It may be created later: retry with backoff.
		return nil, fmt.Errorf("storageClass %q of claim %s: %w", name, klog.KObj(claim), err)
	}
	return class, nil
}
