package provisioner

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	volumehelpers "k8s.io/component-helpers/storage/volume"
)

// localNode is the provisioner running beside the driver on one node
// (--node-deployment), for node-local volumes: it provisions claims whose selected node is
// its own, competes for unclaimed claims with immediate binding by selecting its node
// after a random, growing delay (so the many node provisioners do not stampede), and
// deletes only volumes accessible on its node.
type localNode struct {
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
func newLocalNode(ctx context.Context, opts options, node csi.NodeClient) (*localNode, error) {
	ctx, cancel := context.WithTimeout(ctx, opts.timeout)
	defer cancel()
	info, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		return nil, fmt.Errorf("--node-deployment needs NodeGetInfo from the driver: %w", err)
	}
	return &localNode{
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
func (n *localNode) listers(driver string) (corelisters.NodeLister, storagelisters.CSINodeLister) {
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

// delay is how long to wait before trying to take a claim: random below the base delay at
// first, doubling with each lost attempt up to the maximum.
func (n *localNode) delay(uid string) time.Duration {
	n.mu.Lock()
	defer n.mu.Unlock()
	d := n.baseDelay << min(n.failures[uid], 16)
	d = min(d, n.maxDelay)
	return time.Duration(rand.Int64N(int64(d) + 1))
}

func (n *localNode) failed(uid string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.failures[uid]++
}

func (n *localNode) forget(uid string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.failures, uid)
}

// holds tells whether the volume is accessible on this node, i.e. this node's provisioner
// created it and deletes it.
func (n *localNode) holds(pv *v1.PersistentVolume) bool {
	return volumehelpers.CheckNodeAffinity(pv, n.info.GetAccessibleTopology().GetSegments()) == nil
}
