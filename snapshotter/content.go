package snapshotter

import (
	"context"
	"errors"
	"fmt"

	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snaplisters "github.com/kubernetes-csi/external-snapshotter/client/v8/listers/volumesnapshot/v1"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// The finalizer and annotations the snapshot-controller and this sidecar exchange on a
// VolumeSnapshotContent (upstream's names).
const (
	// contentFinalizer is put on by the snapshot-controller; the sidecar removes it once the
	// snapshot the content records is deleted (or kept, by policy).
	contentFinalizer = "snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection"
	// annBeingCreated is this sidecar's record that CreateSnapshot may be running for the
	// content: it is written before the call and removed once the result is on the
	// content's status (or the call failed for good). While it is there the content is not
	// deleted, so no snapshot the driver takes is left unrecorded.
	annBeingCreated = "snapshot.storage.kubernetes.io/volumesnapshot-being-created"
	// annBeingDeleted is the snapshot-controller's: the content may be deleted now.
	annBeingDeleted = "snapshot.storage.kubernetes.io/volumesnapshot-being-deleted"
	// annGroupMember marks a content that is a member of a group snapshot: the group's
	// CreateVolumeGroupSnapshot takes it, never CreateSnapshot.
	annGroupMember = "groupsnapshot.storage.k8s.io/volumeGroupSnapshotHandle"
)

// contentQueueName is upstream's workqueue name.
const contentQueueName = "csi-snapshotter-content"

// errPending requeues a content with backoff without it being an error: its snapshot is
// not ready yet, and the driver is asked again later (upstream's polling).
var errPending = errors.New("snapshot not ready yet")

// contentController takes, checks and deletes the snapshots of the driver's
// VolumeSnapshotContents.
type contentController struct {
	controllerConfig
	*contents[*snapv1.VolumeSnapshotContent]
	classes snaplisters.VolumeSnapshotClassLister
}

func newContentController(cfg controllerConfig) (*contentController, error) {
	informer := cfg.clients.contentFactory.Snapshot().V1().VolumeSnapshotContents().Informer()
	classes := cfg.clients.classFactory.Snapshot().V1().VolumeSnapshotClasses()
	shared, err := newContents(contentsConfig[*snapv1.VolumeSnapshotContent]{
		kind: "VolumeSnapshotContent",
		queue: lifecycle.QueueOptions{Name: contentQueueName,
			RetryStart: cfg.retryStart, RetryMax: cfg.retryMax, Backlog: cfg.backlog},
		resync:   cfg.resync,
		patcher:  cfg.clients.snap.SnapshotV1().VolumeSnapshotContents().Patch,
		recorder: cfg.recorder,
		rules:    contentRules(),
	}, informer, classes.Informer().HasSynced)
	if err != nil {
		return nil, err
	}
	return &contentController{controllerConfig: cfg, contents: shared, classes: classes.Lister()}, nil
}

// contentRules: the being-created annotation and the status are the sidecar's, except
// that the snapshot-controller writes a group member's status (its handle and readiness as
// the group snapshot's member list says, again whenever it syncs the group): a member
// whose status it left not ready is checked then, not at the next resync (upstream waits
// for that, 15 minutes by default).
func contentRules() kindRules[*snapv1.VolumeSnapshotContent] {
	return kindRules[*snapv1.VolumeSnapshotContent]{creating: annBeingCreated, ready: isReady,
		dropState: func(c *snapv1.VolumeSnapshotContent) { c.Status = nil },
		wake: func(old, obj *snapv1.VolumeSnapshotContent) bool {
			return isGroupMember(obj) && hasHandle(obj) && !isReady(obj) && !equality.Semantic.DeepEqual(old.Status, obj.Status)
		}}
}

func hasHandle(c *snapv1.VolumeSnapshotContent) bool {
	return c.Status != nil && c.Status.SnapshotHandle != nil
}

func (c *contentController) run(intake, ops context.Context, workers int) {
	c.contents.run(intake, ops, workers, c.sync)
}

// sync brings one content one step on: delete its snapshot, take it, or check it.
func (c *contentController) sync(intake, ops context.Context, content *snapv1.VolumeSnapshotContent) error {
	if !c.ours(content) {
		return nil
	}
	switch {
	case deletionDue(content):
		return c.delete(ops, content)
	case content.Spec.Source.VolumeHandle != nil && content.Status == nil && !isGroupMember(content):
		return c.create(intake, ops, content, "SnapshotCreationFailed", "Failed to create snapshot")
	case isReady(content):
		_, err := c.mark(ops, content, annBeingCreated, false)
		return err
	default:
		return c.check(intake, ops, content)
	}
}

// ours tells whether the content is this driver's (by its class too, where it has one).
func (c *contentController) ours(content *snapv1.VolumeSnapshotContent) bool {
	src := content.Spec.Source
	return c.driver.owns(src.VolumeHandle != nil || src.SnapshotHandle != nil, content.Spec.Driver, content.Spec.VolumeSnapshotClassName,
		func(name string) (string, error) {
			class, err := c.classes.Get(name)
			if err != nil {
				return "", err
			}
			return class.Driver, nil
		})
}

// deletionDue tells whether the content's snapshot may be deleted now (contentDeletionDue).
func deletionDue(content *snapv1.VolumeSnapshotContent) bool {
	unbound := content.Spec.Source.SnapshotHandle != nil && content.Spec.VolumeSnapshotRef.UID == ""
	return contentDeletionDue(content, unbound, annBeingCreated, annBeingDeleted)
}

func isReady(content *snapv1.VolumeSnapshotContent) bool {
	return content.Status != nil && content.Status.ReadyToUse != nil && *content.Status.ReadyToUse
}

func isGroupMember(content *snapv1.VolumeSnapshotContent) bool {
	_, ok := content.Annotations[annGroupMember]
	return ok
}

// create takes the content's snapshot: the being-created record first (a write that starts
// work), then CreateSnapshot, then its result on the status, then the record removed.
// Called again for a snapshot not ready yet, as the CSI spec asks.
func (c *contentController) create(intake, ops context.Context, content *snapv1.VolumeSnapshotContent, reason, what string) error {
	startCtx, cancel := lifecycle.StartingWork(ops, intake)
	defer cancel()
	params, secrets, err := c.createInput(startCtx, content)
	if err != nil {
		if err = lifecycle.IfNotStarted(startCtx, err); !lifecycle.NotStarted(err) {
			c.failed(ops, content, reason, fmt.Sprintf("%s: failed to get input parameters to create snapshot for content %s: %v", what, content.Name, err))
		}
		return err
	}
	name, err := objectName(c.namePrefix, string(content.Spec.VolumeSnapshotRef.UID), c.nameUUIDSize)
	if err != nil {
		c.failed(ops, content, reason, fmt.Sprintf("%s: cannot create snapshot for content %s: %v", what, content.Name, err))
		return err
	}
	// The record is needed until the handle is on the status; a call that only asks
	// whether a recorded snapshot is ready yet needs none (upstream writes it each time).
	if content.Status == nil || content.Status.SnapshotHandle == nil {
		if content, err = c.mark(startCtx, content, annBeingCreated, true); err != nil {
			return lifecycle.IfNotStarted(startCtx, err)
		}
	}
	info, err := c.driver.createSnapshot(ops, name, *content.Spec.Source.VolumeHandle, params, secrets)
	if err != nil {
		if lifecycle.NotStarted(err) {
			return err // left, with its record, to the next leader
		}
		if lifecycle.IsFinalError(err) {
			// Certainly not running in the driver: the content may be deleted.
			if unmarked, uerr := c.mark(ops, content, annBeingCreated, false); uerr == nil {
				content = unmarked
			}
		}
		c.failed(ops, content, reason, fmt.Sprintf("%s: failed to take snapshot of the volume %s: %q", what, *content.Spec.Source.VolumeHandle, err))
		return err
	}
	content, err = c.recordStatus(ops, content, info)
	if err != nil {
		return err
	}
	if _, err := c.mark(ops, content, annBeingCreated, false); err != nil {
		return err
	}
	if !info.ready {
		return errPending
	}
	if content.DeletionTimestamp != nil {
		c.queue.Add(content.Name) // deleted while it was being taken
	}
	return nil
}

// createInput is what CreateSnapshot needs: the class's parameters (with the extra
// metadata when asked) and the snapshotter secret the snapshot-controller named on the
// content.
func (c *contentController) createInput(ctx context.Context, content *snapv1.VolumeSnapshotContent) (params, secrets map[string]string, err error) {
	if content.Spec.VolumeSnapshotRef.UID == "" {
		return nil, nil, fmt.Errorf("content %s is not bound to a VolumeSnapshot", content.Name)
	}
	if content.Spec.VolumeSnapshotClassName == nil {
		return nil, nil, fmt.Errorf("failed to take snapshot %s without a snapshot class", content.Name)
	}
	class, err := c.classes.Get(*content.Spec.VolumeSnapshotClassName)
	if err != nil {
		return nil, nil, fmt.Errorf("snapshot class %s: %w", *content.Spec.VolumeSnapshotClassName, err)
	}
	params, err = driverParameters(class.Parameters)
	if err != nil {
		return nil, nil, err
	}
	if c.extraCreate {
		params[paramSnapshotName] = content.Spec.VolumeSnapshotRef.Name
		params[paramSnapshotNamespace] = content.Spec.VolumeSnapshotRef.Namespace
		params[paramContentName] = content.Name
	}
	secrets, err = c.contentSecrets(ctx, content)
	return params, secrets, err
}

// contentSecrets reads the snapshotter secret named on the content, if any.
func (c *contentController) contentSecrets(ctx context.Context, content *snapv1.VolumeSnapshotContent) (map[string]string, error) {
	ref, err := annotatedSecret(content.Annotations, annDeletionSecretName, annDeletionSecretNamespace)
	if err != nil {
		return nil, err
	}
	return credentials(ctx, c.clients.kube, ref)
}

// check asks the driver about a snapshot that is not ready yet: a pre-provisioned one or a
// group member through ListSnapshots, a dynamic one by calling CreateSnapshot again.
func (c *contentController) check(intake, ops context.Context, content *snapv1.VolumeSnapshotContent) error {
	const reason, what = "SnapshotContentCheckandUpdateFailed", "Failed to check and update snapshot content"
	member := content.Status != nil && content.Status.VolumeGroupSnapshotHandle != nil
	if content.Spec.Source.SnapshotHandle == nil && !(member && content.Status.SnapshotHandle != nil) {
		if isGroupMember(content) {
			return nil // the group's CreateVolumeGroupSnapshot records it
		}
		return c.create(intake, ops, content, reason, what)
	}
	startCtx, cancel := lifecycle.StartingWork(ops, intake)
	defer cancel()
	secrets, err := c.listSecrets(startCtx, content, member)
	if err != nil {
		if err = lifecycle.IfNotStarted(startCtx, err); !lifecycle.NotStarted(err) {
			c.failed(ops, content, reason, fmt.Sprintf("%s: %v", what, err))
		}
		return err
	}
	id := ""
	if h := content.Spec.Source.SnapshotHandle; h != nil {
		id = *h
	} else {
		id = *content.Status.SnapshotHandle
	}
	info, err := c.driver.snapshotStatus(ops, id, secrets)
	if err != nil {
		if !lifecycle.NotStarted(err) {
			c.failed(ops, content, reason, fmt.Sprintf("%s: failed to list snapshot for content %s: %q", what, content.Name, err))
		}
		return err
	}
	info.id = id
	if _, err := c.recordStatus(ops, content, info); err != nil {
		return err
	}
	if !info.ready {
		return errPending
	}
	return nil
}

// listSecrets is the secret ListSnapshots gets: the class's snapshotter-list secret, or for
// a group member the snapshotter secret named on the content.
func (c *contentController) listSecrets(ctx context.Context, content *snapv1.VolumeSnapshotContent, member bool) (map[string]string, error) {
	if member {
		return c.contentSecrets(ctx, content)
	}
	if content.Spec.VolumeSnapshotClassName == nil {
		return nil, nil
	}
	class, err := c.classes.Get(*content.Spec.VolumeSnapshotClassName)
	if err != nil {
		return nil, fmt.Errorf("failed to get snapshot class %s for snapshot content %s: %w", *content.Spec.VolumeSnapshotClassName, content.Name, err)
	}
	ref, err := secretRef(class.Parameters, paramListSecretName, paramListSecretNamespace, "volumesnapshotcontent.name", content.Name)
	if err != nil {
		return nil, fmt.Errorf("failed to get secret reference for snapshot content %s: %w", content.Name, err)
	}
	return credentials(ctx, c.clients.kube, ref)
}

// delete deletes the content's snapshot if its policy says so, then lets the content go.
func (c *contentController) delete(ops context.Context, content *snapv1.VolumeSnapshotContent) error {
	st := content.Status
	if content.Spec.DeletionPolicy == snapv1.VolumeSnapshotContentDelete && st != nil && st.SnapshotHandle != nil &&
		st.VolumeGroupSnapshotHandle == nil && !c.wasDeleted(content) {
		secrets, err := c.contentSecrets(ops, content)
		if err != nil {
			c.contents.recorder.Event(content, v1.EventTypeWarning, "SnapshotDeleteError", "Failed to get snapshot credentials")
			return fmt.Errorf("failed to get input parameters to delete snapshot for content %s: %w", content.Name, err)
		}
		if err := c.driver.deleteSnapshot(ops, *st.SnapshotHandle, secrets); err != nil {
			if !lifecycle.NotStarted(err) {
				c.contents.recorder.Event(content, v1.EventTypeWarning, "SnapshotDeleteError", "Failed to delete snapshot")
			}
			return fmt.Errorf("failed to delete snapshot %s of content %s: %w", *st.SnapshotHandle, content.Name, err)
		}
		c.noteDeleted(content)
	}
	return c.release(ops, content)
}
