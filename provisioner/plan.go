// A claim's plan (planner): everything CreateVolume and the PersistentVolume need,
// read from the claim, its class, secrets, topology and data source.

package provisioner

import (
	"context"
	"errors"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/record"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// plan is one claim's CreateVolume, made once and retried as it is: the same name and
// arguments make the retry idempotent in the driver.
type plan struct {
	claim  *v1.PersistentVolumeClaim
	class  *storagev1.StorageClass
	pvName string
	req    *csi.CreateVolumeRequest
	// pv is the PersistentVolume to record, but for the volume CreateVolume returns.
	pv pvInput
	// mayReschedule: a node was selected and the driver has topology, so a final error
	// can send the claim back to the scheduler.
	mayReschedule bool
	// source is the claim or snapshot the volume is made from, protected by a finalizer
	// while the volume is in creation.
	source request.SourceRef
	// rec is the record on the claim that describes this CreateVolume; set before it is
	// sent.
	rec *record.Record
}

// rescheduleError is a failure the scheduler should hear about: the selected node cannot
// get the volume (gone, or unknown to the driver).
type rescheduleError struct{ err error }

func (e rescheduleError) Error() string { return e.err.Error() }
func (e rescheduleError) Unwrap() error { return e.err }

// planner makes a claim's plan: it reads the claim's class, the cluster's topology, the
// provisioner secret, the VolumeAttributesClass and the data source, and builds the
// request. It holds no state of its own beyond its caches and writes nothing.
type planner struct {
	*config
	classes  storagelisters.StorageClassLister
	volumes  corelisters.PersistentVolumeLister
	nodes    corelisters.NodeLister       // nil without topology
	csiNodes storagelisters.CSINodeLister // nil without topology
	// claims is the claim cache through this process's own writes (a clone's source).
	claims *lifecycle.OwnWrites[*v1.PersistentVolumeClaim]
	// snapshots is nil without snapshot support (a restore's source).
	snapshots snapclientset.Interface
	// access says whether a claim may use a source of another namespace.
	access sourceAccess
	// startingWork is the context of the plan's reads: they end with intake and wait
	// behind the requests that finish work (P14).
	startingWork func(context.Context) (context.Context, context.CancelFunc)
}

// plan reads what CreateVolume needs (listers, the provisioner secret, the
// VolumeAttributesClass) and builds the request. It returns no plan with an error the user
// must hear about; it makes no CSI call.
func (c *planner) plan(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass) (_ *plan, err error) {
	source, err := request.ClaimSource(claim)
	if err != nil {
		return nil, err
	}
	if err := c.access.check(claim, source); err != nil {
		return nil, err
	}
	if err := request.CheckSourceCapability(c.controllerCaps, source.Kind); err != nil {
		return nil, err
	}
	var vacName string
	if c.vac && claim.Spec.VolumeAttributesClassName != nil {
		vacName = *claim.Spec.VolumeAttributesClassName
	}
	if err := request.CheckCapabilities(c.pluginCaps, c.controllerCaps, vacName != ""); err != nil {
		return nil, err
	}
	if claim.Spec.Selector != nil {
		return nil, fmt.Errorf("claim Selector is not supported")
	}
	var pvName string
	pvName, err = request.VolumeName(c.opts.volumeNamePrefix, claim.UID, c.opts.volumeNameUUIDLength)
	if err != nil {
		return nil, err
	}
	// A class of the in-tree plugin the driver replaces is read in its CSI translation;
	// the claim, the events and the PersistentVolume keep the class as it is.
	csiClass, migrated, err := c.names().CSIClass(class)
	if err != nil {
		return nil, err
	}
	fsType, err := request.FSTypeFor(csiClass.Parameters, c.opts.defaultFSType)
	if err != nil {
		return nil, err
	}
	caps, err := request.VolumeCapabilities(claim, fsType, csiClass.MountOptions, c.controllerCaps[csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER])
	if err != nil {
		return nil, err
	}
	params, err := request.DriverParameters(csiClass.Parameters)
	if err != nil {
		return nil, fmt.Errorf("failed to strip CSI Parameters of prefixed keys: %w", err)
	}
	if c.opts.extraCreateMetadata {
		request.AddExtraMetadata(params, claim, pvName)
	}
	refs, err := request.ResolveSecretRefs(csiClass.Parameters, pvName, claim)
	if err != nil {
		return nil, err
	}
	req := &csi.CreateVolumeRequest{
		Name:               pvName,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: request.RequestedBytes(claim)},
		VolumeCapabilities: caps,
		Parameters:         params,
	}
	selectedNode := claim.Annotations[volumehelpers.AnnSelectedNode]
	if c.topology {
		if req.AccessibilityRequirements, err = c.requirements(claim, csiClass, selectedNode); err != nil {
			return nil, err
		}
	}
	// The plan's reads start work: they end with intake and wait behind the requests
	// that finish work (P14).
	ctx, cancel := c.startingWork(c.ops)
	defer cancel()
	defer func() { err = lifecycle.IfNotStarted(ctx, err) }()
	if vacName != "" {
		vac, err := c.kube.StorageV1().VolumeAttributesClasses().Get(ctx, vacName, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("getting VolumeAttributesClass %s: %w", vacName, err)
		}
		if vac.DriverName != c.driver {
			return nil, fmt.Errorf("VAC %s referenced in PVC is for driver %s which does not match driver name %s", vacName, vac.DriverName, c.driver)
		}
		req.MutableParameters = vac.Parameters
	}
	if req.VolumeContentSource, err = c.contentSource(ctx, claim, class, source); err != nil {
		return nil, err
	}
	if req.Secrets, err = request.ReadSecret(ctx, c.kube, refs.Provisioner); err != nil {
		return nil, err
	}
	return &plan{
		claim:  claim,
		class:  class,
		pvName: pvName,
		req:    req,
		pv: pvInput{
			name:           pvName,
			driver:         c.driver,
			claim:          claim,
			class:          class,
			fsType:         fsType,
			secrets:        refs,
			readOnly:       readOnlyPV(caps, c.opts.controllerPublishReadOnly),
			requestedBytes: req.CapacityRange.RequiredBytes,
			identity:       c.identity,
			topology:       c.topology,
			vac:            vacName,
			fromSource:     req.VolumeContentSource != nil,
			migrated:       migrated,
		},
		mayReschedule: c.topology && selectedNode != "",
		source:        source,
	}, nil
}

// requirements gathers the topology of the cluster from the listers and computes the
// accessibility requirement. A selected node that is gone, or that the driver never
// registered on, sends the claim back to the scheduler.
func (c *planner) requirements(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, selectedNode string) (*csi.TopologyRequirement, error) {
	in := request.TopologyInput{
		Driver:    c.driver,
		ClaimName: claim.Name,
		Allowed:   class.AllowedTopologies,
		Strict:    c.opts.strictTopology,
		Immediate: c.opts.immediateTopology,
	}
	if selectedNode != "" {
		node, err := c.nodes.Get(selectedNode)
		if apierrors.IsNotFound(err) {
			return nil, rescheduleError{fmt.Errorf("selected node %q does not exist", selectedNode)}
		} else if err != nil {
			return nil, err
		}
		csiNode, err := c.csiNodes.Get(selectedNode)
		if apierrors.IsNotFound(err) {
			return nil, rescheduleError{fmt.Errorf("CSINode of selected node %q does not exist", selectedNode)}
		} else if err != nil {
			return nil, err
		}
		in.SelectedNode, in.SelectedCSINode = node, csiNode
	}
	var err error
	if in.CSINodes, err = c.csiNodes.List(labels.Everything()); err != nil {
		return nil, err
	}
	if in.Nodes, err = c.nodes.List(labels.Everything()); err != nil {
		return nil, err
	}
	req, err := request.AccessibilityRequirements(in)
	if err != nil {
		return nil, fmt.Errorf("error generating accessibility requirements: %w", err)
	}
	return req, nil
}

// contentSource reads the claim's source and checks it (request.CloneSource, request.SnapshotSource).
func (c *planner) contentSource(ctx context.Context, claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, ref request.SourceRef) (*csi.VolumeContentSource, error) {
	var (
		src *csi.VolumeContentSource
		err error
	)
	switch ref.Kind {
	case request.SourceClone:
		source, _, _ := c.claims.Get(ref.Namespace + "/" + ref.Name)
		var sourcePV *v1.PersistentVolume
		if source != nil && source.Spec.VolumeName != "" {
			sourcePV, _ = c.volumes.Get(source.Spec.VolumeName)
		}
		src, err = request.CloneSource(claim, class, source, sourcePV)
	case request.SourceSnapshot:
		src, err = c.snapshotContentSource(ctx, claim, class, ref)
	default:
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("error getting handle for DataSource Type %s by Name %s: %w", dataSourceKind(claim), ref.Name, err)
	}
	return src, nil
}

// snapshotContentSource reads the snapshot and its content from the API server (fresh:
// the snapshot controller may just have bound them) on ctx.
func (c *planner) snapshotContentSource(ctx context.Context, claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, ref request.SourceRef) (*csi.VolumeContentSource, error) {
	if c.snapshots == nil {
		return nil, fmt.Errorf("the %s API is not served by the cluster", snapshotv1.SchemeGroupVersion)
	}
	snap, err := c.snapshots.SnapshotV1().VolumeSnapshots(ref.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("error getting snapshot %s from api server: %w", ref.Name, err)
	}
	var content *snapshotv1.VolumeSnapshotContent
	if snap.Status != nil && snap.Status.BoundVolumeSnapshotContentName != nil {
		content, err = c.snapshots.SnapshotV1().VolumeSnapshotContents().Get(ctx, *snap.Status.BoundVolumeSnapshotContentName, metav1.GetOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("error getting snapshotcontent %s: %w", *snap.Status.BoundVolumeSnapshotContentName, err)
		}
		if err != nil {
			content = nil
		}
	}
	return request.SnapshotSource(claim, class, snap, content, c.opts.preventVolumeModeConversion)
}

// nodeHasCapacity asks the driver whether node has room for the claim's volume, with the
// request a plan for the node would make: GetCapacity per requisite segment (once without
// a segment when there is none), enough in one of them is enough, as upstream's
// checkCapacity. A claim without a size fits; a driver without GET_CAPACITY is not asked
// (upstream asks and proceeds on the error). The call runs on Ops() like every CSI call.
func (c *planner) nodeHasCapacity(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, node string) (bool, error) {
	size := request.RequestedBytes(claim)
	if size == 0 {
		return true, nil
	}
	if !c.controllerCaps[csi.ControllerServiceCapability_RPC_GET_CAPACITY] {
		return false, errors.New("the driver does not report the GET_CAPACITY controller capability")
	}
	selected := claim.DeepCopy()
	if selected.Annotations == nil {
		selected.Annotations = map[string]string{}
	}
	selected.Annotations[volumehelpers.AnnSelectedNode] = node
	p, err := c.plan(selected, class)
	if err != nil {
		return false, err
	}
	topologies := []*csi.Topology{nil}
	if ar := p.req.GetAccessibilityRequirements(); len(ar.GetRequisite()) > 0 {
		topologies = ar.GetRequisite()
	}
	for _, t := range topologies {
		ctx, cancel := context.WithTimeout(lifecycle.MarkMigrated(c.ops, p.pv.migrated), c.opts.timeout)
		resp, err := c.csi.GetCapacity(ctx, &csi.GetCapacityRequest{VolumeCapabilities: p.req.GetVolumeCapabilities(), Parameters: p.req.GetParameters(), AccessibleTopology: t})
		cancel()
		if err != nil {
			return false, fmt.Errorf("GetCapacity: %w", err)
		}
		if size <= resp.GetAvailableCapacity() {
			return true, nil
		}
	}
	return false, nil
}
