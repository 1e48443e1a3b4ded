// The undo (undoer), when no claim wants the volume a record says may exist: the volume
// is deleted in the driver and the record closed (ProvisioningUndone).

package provisioner

import (
	"context"
	"fmt"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/record"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// undoer deletes the volume a claim no longer wants, or that a record says may exist while
// nothing wants it, and closes the record. It hands back to the claim's way (claimWay) a
// volume that has a PersistentVolume after all, a plan that ended and a claim to decide
// again.
type undoer struct {
	*config
	records *record.Store
	// classes give the claim's class, whose secret an undo of a recorded request uses.
	classes storagelisters.StorageClassLister
	// absent is shared with the claim's way, which knows from CreateVolume's answers too.
	absent *absentVolumes
	claims claimWay
}

// claimWay is what the undo needs of the claim's way.
type claimWay interface {
	claimByUID(uid string) *v1.PersistentVolumeClaim
	// recorded ends a record whose volume a PersistentVolume records.
	recorded(ctx context.Context, uid string, claim *v1.PersistentVolumeClaim, p *plan, rec *record.Record) error
	// finish ends a plan.
	finish(uid string, p *plan)
	// requeue decides the claim again.
	requeue(uid string)
}

// undo deletes the volume a claim no longer wants, then closes the record, all on ctx
// (Ops(), P1). The volume's ID is learned by sending the recorded CreateVolume again: CSI
// makes it return the volume of that name if there is one; if there is none the driver
// creates it, and it is deleted the same way. A final error means the driver does not
// have the volume. Every failure is an event on the claim, and the record stays open until
// the volume is known deleted.
func (u *undoer) undo(ctx context.Context, uid string, claim *v1.PersistentVolumeClaim, p *plan, rec *record.Record, why string) error {
	logger := klog.FromContext(ctx).WithValues("volume", rec.Volume, "reason", why)
	// The cache may not show a PersistentVolume saved a moment ago (by the previous
	// leader): deleting its volume would leave it without one. Ask the API server.
	_, err := u.kube.CoreV1().PersistentVolumes().Get(ctx, rec.Volume, metav1.GetOptions{})
	switch {
	case err == nil:
		logger.V(2).Info("The volume has a PersistentVolume after all; closing the record")
		return u.claims.recorded(ctx, uid, claim, p, rec)
	case !apierrors.IsNotFound(err):
		return fmt.Errorf("checking for PersistentVolume %s before deleting its volume: %w", rec.Volume, err)
	}
	deleted := false
	if !u.absent.is(uid, rec.Volume) {
		req, err := u.undoRequest(ctx, claim, p, rec)
		if err != nil {
			return u.undoFailed(ctx, claim, rec, why, err)
		}
		id, err := u.learnVolumeID(ctx, req)
		if err != nil {
			return u.undoFailed(ctx, claim, rec, why, err)
		}
		if id != "" {
			if err := u.deleteBackendVolume(ctx, id, req.GetSecrets()); err != nil {
				return u.undoFailed(ctx, claim, rec, why, fmt.Errorf("DeleteVolume %s: %w", id, err))
			}
			deleted = true
			if owner := p.claimOr(claim); owner != nil {
				u.capacityChanged(volumehelpers.GetPersistentVolumeClaimClass(owner), nil)
			}
		}
		// Known absent now: a retry of the write below must not create it again.
		u.absent.mark(uid, rec.Volume)
	}
	what := fmt.Sprintf("the driver had no volume %s", rec.Volume)
	if deleted {
		what = fmt.Sprintf("volume %s deleted", rec.Volume)
	}
	return u.undone(ctx, uid, claim, p, rec, why, what)
}

// discard deletes a volume just created for a claim that no longer wants it, then closes
// the record; a failure leaves the plan pending, and the retry undoes it.
func (u *undoer) discard(ctx context.Context, uid string, p *plan, id, why string) error {
	claim := u.claims.claimByUID(uid)
	if err := u.deleteBackendVolume(lifecycle.MarkMigrated(ctx, p.pv.migrated), id, p.req.GetSecrets()); err != nil {
		return u.undoFailed(ctx, claim, p.rec, why, fmt.Errorf("DeleteVolume %s: %w", id, err))
	}
	u.absent.mark(uid, p.pvName)
	u.capacityChanged(p.class.Name, nil)
	return u.undone(ctx, uid, claim, p, p.rec, why, fmt.Sprintf("volume %s deleted", p.pvName))
}

// Event reasons of the record's undo (ours: upstream never undoes a provisioning).
const (
	reasonUndone     = "ProvisioningUndone"
	reasonUndoFailed = "ProvisioningUndoFailed"
	reasonUntrusted  = "ProvisioningRecordUntrusted"
)

// absentVolumes remembers, by claim UID, a recorded volume the driver gave a final answer
// about (it does not have it, or it was deleted): an undo of it needs no CSI call. Memory
// only: a new leader replays the CreateVolume, which is what CSI's idempotency is for.
type absentVolumes struct {
	mu sync.Mutex
	m  map[string]string
}

func (a *absentVolumes) mark(uid, volume string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.m == nil {
		a.m = map[string]string{}
	}
	a.m[uid] = volume
}

func (a *absentVolumes) forget(uid string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.m, uid)
}

func (a *absentVolumes) is(uid, volume string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	v, ok := a.m[uid]
	return ok && v == volume
}

// undone closes the record of a volume known absent with a ProvisioningUndone event; the
// plan, if any, is done.
func (u *undoer) undone(ctx context.Context, uid string, claim *v1.PersistentVolumeClaim, p *plan, rec *record.Record, why, what string) error {
	logger := klog.FromContext(ctx).WithValues("volume", rec.Volume, "reason", why)
	if err := u.records.CloseFor(ctx, uid, claim, rec, v1.EventTypeNormal, reasonUndone, fmt.Sprintf("Provisioning undone (%s): %s", why, what)); err != nil {
		logger.Error(err, "Volume known absent, but the provisioning record cannot be closed; retrying")
		return err
	}
	u.absent.forget(uid)
	if p != nil {
		u.claims.finish(uid, p)
	}
	logger.V(2).Info("Provisioning undone", "what", what)
	if claim != nil {
		// It may want a volume still (on another node, under another name): closing the
		// record changed nothing that would bring it back.
		u.claims.requeue(uid)
	}
	return nil
}

// claimOr is the plan's claim, else claim.
func (p *plan) claimOr(claim *v1.PersistentVolumeClaim) *v1.PersistentVolumeClaim {
	if p != nil {
		return p.claim
	}
	return claim
}

// undoFailed reports a failed undo on the claim, or, the claim gone, on the reference its
// record names (a stuck backend must not be silence), and returns the error for a retry
// with backoff.
func (u *undoer) undoFailed(ctx context.Context, claim *v1.PersistentVolumeClaim, rec *record.Record, why string, err error) error {
	err = fmt.Errorf("undoing the provisioning of volume %s (%s): %w", rec.Volume, why, err)
	if lifecycle.NotStarted(err) {
		// Draining or no longer leading: the undo is the next leader's.
		return err
	}
	klog.FromContext(ctx).Error(err, "The volume may exist in the driver; its record stays open until it is known deleted")
	if about := eventObject(claim, rec); about != nil {
		u.recorder.Eventf(about, v1.EventTypeWarning, reasonUndoFailed, "Volume %s may exist in the driver and %s; retrying: %v", rec.Volume, why, err)
	}
	return err
}

// eventObject is what the recorder reports about: the claim, else a stand-in for the gone
// claim the record names; nil for neither.
func eventObject(claim *v1.PersistentVolumeClaim, rec *record.Record) *v1.PersistentVolumeClaim {
	if claim != nil {
		return claim
	}
	if rec == nil || rec.Claim.Name == "" {
		return nil
	}
	return &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: rec.Claim.Namespace, Name: rec.Claim.Name, UID: rec.Claim.UID}}
}

// undoRequest is the CreateVolume request to send again, secrets included: this
// process's own plan when it has one, else the recorded request with the provisioner
// secret read now. The secret is the one the StorageClass names when the class is still
// there (the record is on an object the claim's owner can edit; the class is not), else
// the recorded one.
func (u *undoer) undoRequest(ctx context.Context, claim *v1.PersistentVolumeClaim, p *plan, rec *record.Record) (*csi.CreateVolumeRequest, error) {
	if p != nil {
		return p.req, nil
	}
	req := proto.Clone(rec.CreateVolumeRequest()).(*csi.CreateVolumeRequest)
	ref := rec.Secret
	if claim != nil {
		// While the claim is there its templates resolve (gone, the recorded secret it is).
		if class, err := classOf(u.classes, claim); err == nil && class != nil {
			if class, _, err := u.names().CSIClass(class); err == nil {
				if fromClass, err := request.SecretReference(request.ProvisionerSecret, class.Parameters, rec.Volume, claim); err == nil {
					ref = fromClass
				}
			}
		}
	}
	secrets, err := request.ReadSecret(ctx, u.kube, ref)
	if err != nil {
		// Without the secret the driver's answer would not say whether the volume exists.
		return nil, fmt.Errorf("the provisioner secret is needed to find the volume: %w", err)
	}
	req.Secrets = secrets
	return req, nil
}

// learnVolumeID sends the request again and returns the volume's ID; "" when the driver
// answers for good that it has no such volume (and is not making it).
func (u *undoer) learnVolumeID(ctx context.Context, req *csi.CreateVolumeRequest) (string, error) {
	callCtx, cancel := context.WithTimeout(ctx, u.opts.timeout)
	defer cancel()
	resp, err := u.csi.CreateVolume(callCtx, req)
	switch {
	case err == nil:
		return resp.GetVolume().GetVolumeId(), nil
	case status.Code(err) == codes.AlreadyExists:
		// A volume of that name exists but not as asked: its ID cannot be learned this way.
		return "", fmt.Errorf("CreateVolume %s: the name is taken by a volume with other parameters: %w", req.GetName(), err)
	case classifyCreateError(err, false) == createInBackground:
		return "", fmt.Errorf("CreateVolume %s, to learn the volume's ID: %w", req.GetName(), err)
	}
	klog.FromContext(ctx).V(2).Info("The driver has no such volume", "volume", req.GetName(), "err", err.Error())
	return "", nil
}

// isAbsentAnswer tells whether a failed CreateVolume says for good that the driver has no
// volume of that name: a final error other than AlreadyExists (which says it has one).
func isAbsentAnswer(err error, outcome createOutcome) bool {
	return outcome != createInBackground && status.Code(err) != codes.AlreadyExists
}
