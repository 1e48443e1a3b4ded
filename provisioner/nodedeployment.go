package provisioner

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/klog/v2"
)

// nodeDeployment is the provisioner running beside the driver on one node
// (--node-deployment), for node-local volumes: it provisions claims whose selected node is
// its own, competes for unclaimed claims with immediate binding by selecting its node
// after a random, growing delay (so the many node provisioners do not stampede), and
// deletes only volumes accessible on its node.
type nodeDeployment struct {
	name             string
	info             *csi.NodeGetInfoResponse
	immediateBinding bool
	baseDelay        time.Duration
	maxDelay         time.Duration

	mu       sync.Mutex
	failures map[string]int // by claim UID: attempts that lost the race
}

// newNodeDeployment asks the driver which node it runs on and where that node is, on
// ctx (Ops()).
func newNodeDeployment(ctx context.Context, opts options, node csi.NodeClient) (*nodeDeployment, error) {
	ctx, cancel := context.WithTimeout(ctx, opts.timeout)
	defer cancel()
	info, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		return nil, fmt.Errorf("--node-deployment needs NodeGetInfo from the driver: %w", err)
	}
	return &nodeDeployment{
		name:             opts.nodeName,
		info:             info,
		immediateBinding: opts.nodeDeploymentImmediateBinding,
		baseDelay:        opts.nodeDeploymentBaseDelay,
		maxDelay:         opts.nodeDeploymentMaxDelay,
		failures:         map[string]int{},
	}, nil
}

// listers are fixed listers holding only this node and its CSINode, made from what the
// driver reported: a node deployment has no reason to watch every Node of the cluster.
func (n *nodeDeployment) listers(driver string) (corelisters.NodeLister, storagelisters.CSINodeLister) {
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.name, Labels: n.info.GetAccessibleTopology().GetSegments()}}
	csiNode := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: n.name}, Spec: storagev1.CSINodeSpec{
		Drivers: []storagev1.CSINodeDriver{{Name: driver, NodeID: n.info.GetNodeId()}},
	}}
	for k := range n.info.GetAccessibleTopology().GetSegments() {
		csiNode.Spec.Drivers[0].TopologyKeys = append(csiNode.Spec.Drivers[0].TopologyKeys, k)
	}
	nodes := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	csiNodes := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	_ = nodes.Add(node)
	_ = csiNodes.Add(csiNode)
	return corelisters.NewNodeLister(nodes), storagelisters.NewCSINodeLister(csiNodes)
}

// owns tells whether this node provisions the claim now. For an immediate-binding claim no
// node has taken yet, it waits a random delay and then takes it by selecting its own node;
// the claim's update brings it back here as owned.
//
// The wait ends with intake (a stopping replica takes no new claims); the write that
// takes the claim runs on Ops().
func (n *nodeDeployment) owns(intake context.Context, c *controller, claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass) (bool, error) {
	switch claim.Annotations[volumehelpers.AnnSelectedNode] {
	case n.name:
		return true, nil
	case "":
	default:
		return false, nil
	}
	if isDelayedBinding(class) || !n.immediateBinding {
		return false, nil
	}
	// The class as the plan reads it: the CSI translation of an in-tree class.
	csiClass, _, err := c.names().csiClass(class)
	if err != nil {
		return false, err
	}
	if len(csiClass.AllowedTopologies) > 0 && c.topology {
		// Take it only if the class allows this node.
		if _, err := c.planner.requirements(claim, csiClass, n.name); err != nil {
			klog.FromContext(intake).V(4).Info("Not taking the claim: its class does not allow this node", "claim", klog.KObj(claim), "err", err.Error())
			return false, nil
		}
	}
	uid := string(claim.UID)
	select {
	case <-intake.Done():
		return false, nil
	case <-time.After(n.delay(uid)):
	}
	current := c.claimByUID(uid)
	if current == nil || current.Annotations[volumehelpers.AnnSelectedNode] != "" {
		// Gone, or another node was faster.
		n.forget(uid)
		return false, nil
	}
	// As late as possible, being a driver call: a node without room for the volume does
	// not take it, so that one with room can (upstream's becomeOwner). A check that
	// fails (a plan error, GetCapacity unanswered) does not stop it: provisioning then
	// fails the same way, with an event the user sees.
	if ok, err := c.planner.nodeHasCapacity(current, class, n.name); err != nil {
		klog.FromContext(intake).V(3).Info("Taking the claim although the capacity check failed", "claim", klog.KObj(claim), "err", err.Error())
	} else if !ok {
		klog.FromContext(intake).V(4).Info("Not taking the claim: not enough capacity on this node", "claim", klog.KObj(claim))
		// A later attempt (the claim's next update or resync) waits longer, as after a
		// lost race.
		n.failed(uid)
		return false, nil
	}
	current = current.DeepCopy()
	current.Annotations[volumehelpers.AnnSelectedNode] = n.name
	apiCtx, cancel := c.startingWork(c.ops)
	defer cancel()
	// Update, not patch: the resource version makes exactly one node win.
	written, err := c.kube.CoreV1().PersistentVolumeClaims(current.Namespace).Update(apiCtx, current, metav1.UpdateOptions{})
	if err != nil {
		n.failed(uid)
		return false, lifecycle.IfNotStarted(apiCtx, fmt.Errorf("selecting node %q for claim %s: %w", n.name, klog.KObj(claim), err))
	}
	c.ownClaims.Wrote(written)
	n.forget(uid)
	return false, nil
}

// nodeHasCapacity asks the driver whether node has room for the claim's volume, with the
// request a plan for the node would make: GetCapacity per requisite segment (once without
// a segment when there is none), enough in one of them is enough, as upstream's
// checkCapacity. A claim without a size fits; a driver without GET_CAPACITY is not asked
// (upstream asks and proceeds on the error). The call runs on Ops() like every CSI call.
func (c *planner) nodeHasCapacity(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, node string) (bool, error) {
	size := requestedBytes(claim)
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

// delay is how long to wait before trying to take a claim: random below the base delay at
// first, doubling with each lost attempt up to the maximum.
func (n *nodeDeployment) delay(uid string) time.Duration {
	n.mu.Lock()
	defer n.mu.Unlock()
	d := n.baseDelay << min(n.failures[uid], 16)
	d = min(d, n.maxDelay)
	return time.Duration(rand.Int64N(int64(d) + 1))
}

func (n *nodeDeployment) failed(uid string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.failures[uid]++
}

func (n *nodeDeployment) forget(uid string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.failures, uid)
}

// holds tells whether the volume is accessible on this node, i.e. this node's provisioner
// created it and deletes it.
func (n *nodeDeployment) holds(pv *v1.PersistentVolume) bool {
	return volumehelpers.CheckNodeAffinity(pv, n.info.GetAccessibleTopology().GetSegments()) == nil
}
