package snapshotter

import (
	"context"
	"fmt"
	"slices"

	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	grouplisters "github.com/kubernetes-csi/external-snapshotter/client/v8/listers/volumegroupsnapshot/v1"
	v1 "k8s.io/api/core/v1"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// The finalizer and annotations the snapshot-controller and this sidecar exchange on a
// VolumeGroupSnapshotContent (upstream's names). They mean what their VolumeSnapshotContent
// counterparts mean (content.go).
const (
	// groupFinalizer is put on by the snapshot-controller; the sidecar removes it once the
	// group snapshot is deleted (or kept, by policy).
	groupFinalizer = "groupsnapshot.storage.kubernetes.io/volumegroupsnapshotcontent-bound-protection"
	// annGroupBeingCreated is written before CreateVolumeGroupSnapshot and removed once its
	// result is on the status (or the call failed for good); while it is there the group
	// content is not deleted, so no group snapshot the driver takes is left unrecorded.
	annGroupBeingCreated = "groupsnapshot.storage.kubernetes.io/volumegroupsnapshot-being-created"
	// annGroupBeingDeleted is the snapshot-controller's: the group snapshot may be deleted.
	annGroupBeingDeleted = "groupsnapshot.storage.kubernetes.io/volumegroupsnapshot-being-deleted"
)

// groupQueueName is upstream's workqueue name.
const groupQueueName = "csi-snapshotter-groupsnapshotcontent"

// The events of a group content, upstream's reasons.
const (
	reasonGroupCreateFailed = "GroupSnapshotCreationFailed"
	reasonGroupCheckFailed  = "GroupSnapshotContentCheckandUpdateFailed"
	reasonGroupDeleteError  = "GroupSnapshotDeleteError"
)

// groupController takes, checks and deletes the group snapshots of the driver's
// VolumeGroupSnapshotContents. It records each group snapshot's members on the group
// content's status (volumeSnapshotInfoList), as upstream's sidecar does; the
// snapshot-controller creates the members' VolumeSnapshots and VolumeSnapshotContents from
// that list, never this sidecar.
type groupController struct {
	controllerConfig
	*contents[*groupv1.VolumeGroupSnapshotContent]
	classes grouplisters.VolumeGroupSnapshotClassLister
}

func newGroupController(cfg controllerConfig) (*groupController, error) {
	informer := cfg.clients.contentFactory.Groupsnapshot().V1().VolumeGroupSnapshotContents().Informer()
	// Upstream reads the classes through the content informer factory, which a
	// --node-deployment snapshotter filters by node label, so it would not see unlabelled
	// classes; they are read unfiltered here, as the VolumeSnapshotClasses are.
	classes := cfg.clients.classFactory.Groupsnapshot().V1().VolumeGroupSnapshotClasses()
	shared, err := newContents(contentsConfig[*groupv1.VolumeGroupSnapshotContent]{
		kind: "VolumeGroupSnapshotContent",
		queue: lifecycle.QueueOptions{Name: groupQueueName,
			RetryStart: cfg.retryStart, RetryMax: cfg.retryMax, Backlog: cfg.backlog},
		resync:   cfg.resync,
		patcher:  cfg.clients.snap.GroupsnapshotV1().VolumeGroupSnapshotContents().Patch,
		recorder: cfg.recorder,
		rules:    groupRules(),
	}, informer, classes.Informer().HasSynced)
	if err != nil {
		return nil, err
	}
	return &groupController{controllerConfig: cfg, contents: shared, classes: classes.Lister()}, nil
}

// groupRules: the being-created annotation and the status are the sidecar's.
func groupRules() kindRules[*groupv1.VolumeGroupSnapshotContent] {
	return kindRules[*groupv1.VolumeGroupSnapshotContent]{creating: annGroupBeingCreated, ready: groupReady,
		dropState: func(c *groupv1.VolumeGroupSnapshotContent) { c.Status = nil }}
}

func (g *groupController) run(intake, ops context.Context, workers int) {
	g.contents.run(intake, ops, workers, g.sync)
}

// sync brings one group content one step on: delete its group snapshot, take it, or check
// it.
func (g *groupController) sync(intake, ops context.Context, content *groupv1.VolumeGroupSnapshotContent) error {
	if !g.ours(content) {
		return nil
	}
	switch {
	case groupDeletionDue(content):
		return g.delete(ops, content)
	case len(content.Spec.Source.VolumeHandles) > 0 && content.Status == nil:
		return g.create(intake, ops, content, reasonGroupCreateFailed, "Failed to create group snapshot")
	case groupReady(content):
		_, err := g.mark(ops, content, annGroupBeingCreated, false)
		return err
	default:
		return g.check(intake, ops, content)
	}
}

// ours tells whether the group content is this driver's (by its class too, where it has
// one the cache knows).
func (g *groupController) ours(content *groupv1.VolumeGroupSnapshotContent) bool {
	src := content.Spec.Source
	return g.driver.owns(src.GroupSnapshotHandles != nil || len(src.VolumeHandles) > 0, content.Spec.Driver, content.Spec.VolumeGroupSnapshotClassName,
		func(name string) (string, error) {
			class, err := g.classes.Get(name)
			if err != nil {
				return "", err
			}
			return class.Driver, nil
		})
}

// groupDeletionDue tells whether the group snapshot may be deleted now
// (contentDeletionDue).
func groupDeletionDue(content *groupv1.VolumeGroupSnapshotContent) bool {
	unbound := content.Spec.Source.GroupSnapshotHandles != nil && content.Spec.VolumeGroupSnapshotRef.UID == ""
	return contentDeletionDue(content, unbound, annGroupBeingCreated, annGroupBeingDeleted)
}

func groupReady(content *groupv1.VolumeGroupSnapshotContent) bool {
	return content.Status != nil && content.Status.ReadyToUse != nil && *content.Status.ReadyToUse
}

// create takes the group snapshot: the being-created record first (a write that starts
// work), then CreateVolumeGroupSnapshot, then its result and its members on the status,
// then the record removed. Called again, as upstream does, for a group snapshot not ready
// yet: the driver answers the same name with the same group snapshot.
func (g *groupController) create(intake, ops context.Context, content *groupv1.VolumeGroupSnapshotContent, reason, what string) error {
	startCtx, cancel := lifecycle.StartingWork(ops, intake)
	defer cancel()
	params, secrets, err := g.createInput(startCtx, content)
	if err != nil {
		if err = lifecycle.IfNotStarted(startCtx, err); !lifecycle.NotStarted(err) {
			g.failed(ops, content, reason, fmt.Sprintf("%s: %v", what, err))
		}
		return err
	}
	name, err := objectName(g.namePrefix, string(content.Spec.VolumeGroupSnapshotRef.UID), g.nameUUIDSize)
	if err != nil {
		g.failed(ops, content, reason, fmt.Sprintf("%s: cannot create group snapshot for group snapshot content %s: %v", what, content.Name, err))
		return err
	}
	// The record is needed until the handle is on the status (see the content's create).
	if content.Status == nil || content.Status.VolumeGroupSnapshotHandle == nil {
		if content, err = g.mark(startCtx, content, annGroupBeingCreated, true); err != nil {
			return lifecycle.IfNotStarted(startCtx, err)
		}
	}
	volumes := content.Spec.Source.VolumeHandles
	info, err := g.driver.createGroupSnapshot(ops, name, volumes, params, secrets)
	if err != nil {
		if lifecycle.NotStarted(err) {
			return err // left, with its record, to the next leader
		}
		if lifecycle.IsFinalError(err) {
			// Certainly not running in the driver: the group content may be deleted.
			if unmarked, uerr := g.mark(ops, content, annGroupBeingCreated, false); uerr == nil {
				content = unmarked
			}
		}
		g.failed(ops, content, reason, fmt.Sprintf("%s: failed to take group snapshot of the volumes %s: %q", what, volumes, err))
		return err
	}
	content, err = g.recordStatus(ops, content, info)
	if err != nil {
		return err
	}
	if _, err := g.mark(ops, content, annGroupBeingCreated, false); err != nil {
		return err
	}
	if !info.ready {
		return errPending
	}
	if content.DeletionTimestamp != nil {
		g.queue.Add(content.Name) // deleted while it was being taken
	}
	return nil
}

// createInput is what CreateVolumeGroupSnapshot needs: the group class's parameters (with
// the extra metadata when asked) and the group snapshotter secret the snapshot-controller
// named on the group content.
func (g *groupController) createInput(ctx context.Context, content *groupv1.VolumeGroupSnapshotContent) (params, secrets map[string]string, err error) {
	if content.Spec.VolumeGroupSnapshotRef.UID == "" {
		return nil, nil, fmt.Errorf("cannot create group snapshot. Group snapshot content %s not bound to a group snapshot", content.Name)
	}
	inputError := func(err error) error {
		return fmt.Errorf("failed to get input parameters to create group snapshot for group snapshot content %s: %w", content.Name, err)
	}
	className := content.Spec.VolumeGroupSnapshotClassName
	if className == nil {
		return nil, nil, inputError(fmt.Errorf("failed to take group snapshot %s without a group snapshot class", content.Name))
	}
	class, err := g.classes.Get(*className)
	if err != nil {
		return nil, nil, inputError(fmt.Errorf("group snapshot class %s: %w", *className, err))
	}
	secrets, err = g.groupSecrets(ctx, content)
	if err != nil {
		return nil, nil, inputError(err)
	}
	params, err = driverParameters(class.Parameters)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to remove CSI Parameters of prefixed keys: %w", err)
	}
	if g.extraCreate {
		params[paramGroupSnapshotName] = content.Spec.VolumeGroupSnapshotRef.Name
		params[paramGroupSnapshotNS] = content.Spec.VolumeGroupSnapshotRef.Namespace
		params[paramGroupContentName] = content.Name
	}
	return params, secrets, nil
}

// groupSecrets reads the group snapshotter secret named on the group content, if any: it
// goes to CreateVolumeGroupSnapshot and DeleteVolumeGroupSnapshot.
func (g *groupController) groupSecrets(ctx context.Context, content *groupv1.VolumeGroupSnapshotContent) (map[string]string, error) {
	ref, err := annotatedSecret(content.Annotations, annGroupSecretName, annGroupSecretNamespace)
	if err != nil {
		return nil, fmt.Errorf("cannot retrieve secrets for group snapshot content %s: %w", content.Name, err)
	}
	return credentials(ctx, g.clients.kube, ref)
}

// check asks the driver about a group snapshot that is not ready yet: a pre-provisioned
// one through GetVolumeGroupSnapshot, a dynamic one by calling CreateVolumeGroupSnapshot
// again (upstream's rule).
func (g *groupController) check(intake, ops context.Context, content *groupv1.VolumeGroupSnapshotContent) error {
	const reason, what = reasonGroupCheckFailed, "Failed to check and update group snapshot content"
	handles := content.Spec.Source.GroupSnapshotHandles
	if handles == nil {
		return g.create(intake, ops, content, reason, what)
	}
	startCtx, cancel := lifecycle.StartingWork(ops, intake)
	defer cancel()
	secrets, err := g.getSecrets(startCtx, content)
	if err != nil {
		if err = lifecycle.IfNotStarted(startCtx, err); !lifecycle.NotStarted(err) {
			g.failed(ops, content, reason, fmt.Sprintf("%s: %v", what, err))
		}
		return err
	}
	if len(handles.VolumeSnapshotHandles) == 0 {
		err := fmt.Errorf("cannot list group snapshot %s. No snapshots found in the group snapshot content", content.Name)
		g.failed(ops, content, reason, fmt.Sprintf("%s: %v", what, err))
		return err
	}
	id := handles.VolumeGroupSnapshotHandle
	if st := content.Status; st != nil && st.VolumeGroupSnapshotHandle != nil {
		id = *st.VolumeGroupSnapshotHandle
	}
	info, err := g.driver.groupSnapshotStatus(ops, id, handles.VolumeSnapshotHandles, secrets)
	if err != nil {
		if !lifecycle.NotStarted(err) {
			g.failed(ops, content, reason, fmt.Sprintf("%s: failed to list group snapshot for group snapshot content %s: %q", what, content.Name, err))
		}
		return err
	}
	// The handle is the group content's own; upstream records no members for a
	// pre-provisioned group snapshot.
	info.id, info.members = handles.VolumeGroupSnapshotHandle, nil
	if _, err := g.recordStatus(ops, content, info); err != nil {
		return err
	}
	if !info.ready {
		return errPending
	}
	return nil
}

// getSecrets is the secret GetVolumeGroupSnapshot gets: the group class's
// group-snapshotter-get secret, if the group content has a class.
func (g *groupController) getSecrets(ctx context.Context, content *groupv1.VolumeGroupSnapshotContent) (map[string]string, error) {
	className := content.Spec.VolumeGroupSnapshotClassName
	if className == nil {
		return nil, nil
	}
	class, err := g.classes.Get(*className)
	if err != nil {
		return nil, fmt.Errorf("failed to get group snapshot class %s for group snapshot content %s: %w", *className, content.Name, err)
	}
	ref, err := secretRef(class.Parameters, paramGroupGetSecretName, paramGroupGetSecretNamespace, "volumegroupsnapshotcontent.name", content.Name)
	if err != nil {
		return nil, fmt.Errorf("failed to get secret reference for group snapshot content %s: %w", content.Name, err)
	}
	secrets, err := credentials(ctx, g.clients.kube, ref)
	if err != nil {
		return nil, fmt.Errorf("failed to get credentials for group snapshot content %s: %w", content.Name, err)
	}
	return secrets, nil
}

// delete deletes the group snapshot if its policy says so, then lets the group content go.
func (g *groupController) delete(ops context.Context, content *groupv1.VolumeGroupSnapshotContent) error {
	st := content.Status
	if content.Spec.DeletionPolicy == snapv1.VolumeSnapshotContentDelete && st != nil && st.VolumeGroupSnapshotHandle != nil &&
		!g.wasDeleted(content) {
		secrets, err := g.groupSecrets(ops, content)
		if err != nil {
			g.contents.recorder.Event(content, v1.EventTypeWarning, reasonGroupDeleteError, "Failed to get snapshot credentials")
			return fmt.Errorf("failed to get input parameters to delete group snapshot for group snapshot content %s: %w", content.Name, err)
		}
		ids := memberIDs(content)
		if len(ids) == 0 {
			g.contents.recorder.Event(content, v1.EventTypeWarning, reasonGroupDeleteError, "Failed to delete group snapshot")
			return fmt.Errorf("cannot delete group snapshot content %s. No snapshots found in the group snapshot", content.Name)
		}
		if err := g.driver.deleteGroupSnapshot(ops, *st.VolumeGroupSnapshotHandle, ids, secrets); err != nil {
			if !lifecycle.NotStarted(err) {
				g.contents.recorder.Event(content, v1.EventTypeWarning, reasonGroupDeleteError, "Failed to delete group snapshot")
			}
			return fmt.Errorf("failed to delete group snapshot %s of group snapshot content %s: %w", *st.VolumeGroupSnapshotHandle, content.Name, err)
		}
		g.noteDeleted(content)
	}
	return g.release(ops, content)
}

// memberIDs are the snapshots DeleteVolumeGroupSnapshot names: those recorded on the status
// of a dynamic group content, or those a pre-provisioned one names.
func memberIDs(content *groupv1.VolumeGroupSnapshotContent) []string {
	if st := content.Status; st != nil && len(st.VolumeSnapshotInfoList) > 0 {
		ids := make([]string, 0, len(st.VolumeSnapshotInfoList))
		for _, m := range st.VolumeSnapshotInfoList {
			ids = append(ids, m.SnapshotHandle)
		}
		return ids
	}
	if h := content.Spec.Source.GroupSnapshotHandles; h != nil {
		return slices.Clone(h.VolumeSnapshotHandles)
	}
	return nil
}
