package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/controlplane"
)

const (
	// AnnControllerManagedAttach on a Node lets kube-controller-manager's attach-detach
	// controller, not the kubelet, attach and detach its volumes (it creates the
	// VolumeAttachments the CSI attacher acts on).
	AnnControllerManagedAttach = "volumes.kubernetes.io/controller-managed-attach-detach"
	// annCSINodeID is the kubelet's record of each CSI driver's node ID on the Node.
	annCSINodeID = "csi.volume.kubernetes.io/nodeid"
	// nodeLeaseNamespace holds a Lease per node, renewed by its kubelet.
	nodeLeaseNamespace = "kube-node-lease"
	heartbeatMessage   = "heartbeat of a fake node (internal/testkit/cluster), no kubelet runs"
)

func defaultNodeCapacity() map[string]string {
	return map[string]string{"cpu": "8", "memory": "32Gi", "pods": "110"}
}

// register creates the CSIDrivers and, for each node, the Node (Ready, with capacity), its
// Lease and its CSINode, as the kubelet and the node plugins' registrars would.
func (c *Cluster) register(ctx context.Context) error {
	for _, name := range c.drivers() {
		driver := &storagev1.CSIDriver{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: storagev1.CSIDriverSpec{
				AttachRequired:       ptr.To(true),
				PodInfoOnMount:       ptr.To(false),
				VolumeLifecycleModes: []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecyclePersistent},
			},
		}
		if _, err := c.kube.StorageV1().CSIDrivers().Create(ctx, driver, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("cluster: create CSIDriver %s: %w", name, err)
		}
	}
	if len(c.nodes) > 0 {
		if err := ensureNamespace(ctx, c.kube, nodeLeaseNamespace); err != nil {
			return err
		}
	}
	capacity := corev1.ResourceList{}
	spec := c.opts.NodeCapacity
	if spec == nil {
		spec = defaultNodeCapacity()
	}
	for name, q := range spec {
		v, err := resource.ParseQuantity(q)
		if err != nil {
			return fmt.Errorf("cluster: node capacity %s=%q: %w", name, q, err)
		}
		capacity[corev1.ResourceName(name)] = v
	}
	for _, name := range c.nodes {
		if err := c.registerNode(ctx, name, capacity); err != nil {
			return err
		}
	}
	return nil
}

func (c *Cluster) registerNode(ctx context.Context, name string, capacity corev1.ResourceList) error {
	id := c.nodeID[name]
	labels := map[string]string{
		corev1.LabelHostname:   name,
		corev1.LabelOSStable:   "linux",
		corev1.LabelArchStable: "amd64",
	}
	annotations := map[string]string{AnnControllerManagedAttach: "true"}
	drivers := c.drivers()
	if len(drivers) > 0 {
		ids := map[string]string{}
		for _, d := range drivers {
			ids[d] = id
		}
		nodeIDs, _ := json.Marshal(ids)
		annotations[annCSINodeID] = string(nodeIDs)
		if c.opts.TopologyKey != "" {
			labels[c.opts.TopologyKey] = id
		}
	}
	now := metav1.Now()
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels, Annotations: annotations},
		// The status goes in with the create, as the kubelet registers a node: capacity for
		// the scheduler, Ready for the node lifecycle controller. Later writes patch only
		// the Ready condition, so the attach-detach controller's volumesAttached stays.
		Status: corev1.NodeStatus{
			Capacity:    capacity,
			Allocatable: capacity,
			Conditions: []corev1.NodeCondition{
				readyCondition(now, now),
				{Type: corev1.NodeMemoryPressure, Status: corev1.ConditionFalse, Reason: "KubeletHasSufficientMemory", LastHeartbeatTime: now, LastTransitionTime: now},
				{Type: corev1.NodeDiskPressure, Status: corev1.ConditionFalse, Reason: "KubeletHasNoDiskPressure", LastHeartbeatTime: now, LastTransitionTime: now},
				{Type: corev1.NodePIDPressure, Status: corev1.ConditionFalse, Reason: "KubeletHasSufficientPID", LastHeartbeatTime: now, LastTransitionTime: now},
			},
			Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "127.0.0.1"}, {Type: corev1.NodeHostName, Address: name}},
			NodeInfo: corev1.NodeSystemInfo{
				KubeletVersion:  controlplane.KubernetesVersion,
				OperatingSystem: "linux",
				Architecture:    "amd64",
			},
		},
	}
	created, err := c.kube.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("cluster: create Node %s: %w", name, err)
	}
	owner := []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: name, UID: created.UID}}
	lease := &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: nodeLeaseNamespace, OwnerReferences: owner},
		Spec: coordinationv1.LeaseSpec{
			HolderIdentity:       ptr.To(name),
			LeaseDurationSeconds: ptr.To[int32](nodeLeaseSeconds),
			RenewTime:            ptr.To(metav1.NowMicro()),
		},
	}
	if _, err := c.kube.CoordinationV1().Leases(nodeLeaseNamespace).Create(ctx, lease, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("cluster: create the Lease of Node %s: %w", name, err)
	}
	if len(drivers) == 0 {
		return nil
	}
	csiNode := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name, OwnerReferences: owner}}
	for _, d := range drivers {
		entry := storagev1.CSINodeDriver{Name: d, NodeID: id}
		if c.opts.TopologyKey != "" {
			entry.TopologyKeys = []string{c.opts.TopologyKey}
		}
		csiNode.Spec.Drivers = append(csiNode.Spec.Drivers, entry)
	}
	if _, err := c.kube.StorageV1().CSINodes().Create(ctx, csiNode, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("cluster: create CSINode %s: %w", name, err)
	}
	return nil
}

func readyCondition(heartbeat, transition metav1.Time) corev1.NodeCondition {
	return corev1.NodeCondition{
		Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", Message: heartbeatMessage,
		LastHeartbeatTime: heartbeat, LastTransitionTime: transition,
	}
}

// unregister deletes what register created; objects already gone are fine.
func (c *Cluster) unregister(ctx context.Context) error {
	var errs []error
	keep := func(err error) {
		if err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	for _, name := range c.nodes {
		keep(c.kube.StorageV1().CSINodes().Delete(ctx, name, metav1.DeleteOptions{}))
		keep(c.kube.CoordinationV1().Leases(nodeLeaseNamespace).Delete(ctx, name, metav1.DeleteOptions{}))
		keep(c.kube.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}))
	}
	for _, d := range c.drivers() {
		keep(c.kube.StorageV1().CSIDrivers().Delete(ctx, d, metav1.DeleteOptions{}))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cluster: delete the nodes' objects: %w", err)
	}
	return nil
}

// startHeartbeats renews every node's Ready condition and Lease each HeartbeatInterval
// until Stop.
func (c *Cluster) startHeartbeats() {
	ctx, cancel := context.WithCancel(context.Background())
	c.stopHeartbeats = cancel
	c.heartbeatsDone = make(chan struct{})
	go func() {
		defer close(c.heartbeatsDone)
		ticker := time.NewTicker(c.opts.HeartbeatInterval)
		defer ticker.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-ticker.C:
			}
			for _, name := range c.nodes {
				err := c.heartbeat(ctx, name)
				if ctx.Err() != nil {
					return
				}
				c.mu.Lock()
				if err != nil {
					c.heartbeatN++
				}
				c.heartbeatErr = err
				c.mu.Unlock()
			}
		}
	}()
}

// heartbeat is one kubelet status report and Lease renewal of a node. The status is a
// strategic merge patch of the Ready condition alone (conditions merge by type): a whole
// status written back would race the attach-detach controller's volumesAttached and could
// drop its latest entries. lastTransitionTime is left out so that it keeps its value.
func (c *Cluster) heartbeat(ctx context.Context, name string) error {
	type condition struct {
		Type              corev1.NodeConditionType `json:"type"`
		Status            corev1.ConditionStatus   `json:"status"`
		Reason            string                   `json:"reason"`
		Message           string                   `json:"message"`
		LastHeartbeatTime metav1.Time              `json:"lastHeartbeatTime"`
	}
	type status struct {
		Conditions []condition `json:"conditions"`
	}
	patch, err := json.Marshal(struct {
		Status status `json:"status"`
	}{status{[]condition{{corev1.NodeReady, corev1.ConditionTrue, "KubeletReady", heartbeatMessage, metav1.Now()}}}})
	if err != nil {
		return err
	}
	if _, err := c.kube.CoreV1().Nodes().Patch(ctx, name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		return fmt.Errorf("node %s status: %w", name, err)
	}
	renew, err := json.Marshal(map[string]any{"spec": map[string]any{"renewTime": metav1.NowMicro()}})
	if err != nil {
		return err
	}
	if _, err := c.kube.CoordinationV1().Leases(nodeLeaseNamespace).Patch(ctx, name, types.MergePatchType, renew, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("node %s Lease: %w", name, err)
	}
	return nil
}

// waitSchedulable waits until the node lifecycle controller has removed the not-ready
// taint every new Node gets from admission (TaintNodesByCondition).
func (c *Cluster) waitSchedulable(ctx context.Context) error {
	var waiting []string
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if err := c.Running(); err != nil {
			return false, err
		}
		waiting = waiting[:0]
		for _, name := range c.nodes {
			node, err := c.kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, nil //nolint:nilerr // a failed read is retried until ctx ends
			}
			for _, t := range node.Spec.Taints {
				if t.Key == corev1.TaintNodeNotReady || t.Key == corev1.TaintNodeUnreachable {
					waiting = append(waiting, name+" ("+t.Key+")")
				}
			}
		}
		return len(waiting) == 0, nil
	})
	if err != nil {
		return fmt.Errorf("cluster: nodes still tainted %s: %w\n%s", strings.Join(waiting, ", "), err, c.Diagnostics())
	}
	return nil
}

// EnsureServiceAccount creates the "default" ServiceAccount of a namespace unless it is
// there: a Pod cannot be created without it, and kube-controller-manager's
// serviceaccount-controller creates it only some time after the namespace (or not at all
// when it does not run).
func EnsureServiceAccount(ctx context.Context, kube kubernetes.Interface, namespace string) error {
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: namespace}}
	_, err := kube.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("cluster: create the default ServiceAccount of %s: %w", namespace, err)
	}
	return nil
}

// ensureNamespace creates a namespace unless it is there (kube-apiserver creates
// kube-node-lease itself, shortly after it starts).
func ensureNamespace(ctx context.Context, kube kubernetes.Interface, name string) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	_, err := kube.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("cluster: create namespace %s: %w", name, err)
	}
	return nil
}
