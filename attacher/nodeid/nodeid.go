// Package nodeid finds the driver's ID of a VolumeAttachment's node, the NodeId of
// ControllerPublishVolume and ControllerUnpublishVolume: from the node's CSINode, from the
// ID the attacher recorded on the VolumeAttachment when it published it (so that a
// volume can be unpublished after the CSINode is gone), or from the Node's older
// annotation. The annotations are upstream's (P9).
package nodeid

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	storagelisters "k8s.io/client-go/listers/storage/v1"
)

const (
	// Annotation on a VolumeAttachment records the node ID it was published to, so it can
	// be unpublished when the CSINode is gone.
	Annotation = "csi.alpha.kubernetes.io/node-id"
	// NodesAnnotation on a Node is the kubelet's older record of node IDs: a JSON map from
	// driver name to node ID.
	NodesAnnotation = "csi.volume.kubernetes.io/nodeid"
)

// Lookup finds the node IDs of one driver.
type Lookup struct {
	driver   string
	csiNodes storagelisters.CSINodeLister
	kube     kubernetes.Interface
}

// New returns the lookup of driver's node IDs, reading CSINodes from csiNodes and Nodes
// from the API.
func New(driver string, csiNodes storagelisters.CSINodeLister, kube kubernetes.Interface) *Lookup {
	return &Lookup{driver: driver, csiNodes: csiNodes, kube: kube}
}

// Find is the driver's ID of the VolumeAttachment's node: from the CSINode, else
// (detaching) from the ID recorded on the VolumeAttachment when it was published, else
// from the Node's older csi.volume.kubernetes.io/nodeid annotation.
func (l *Lookup) Find(ctx context.Context, va *storagev1.VolumeAttachment, detaching bool) (string, error) {
	nodeName := va.Spec.NodeName
	csiNode, err := l.csiNodes.Get(nodeName)
	if err == nil {
		if id, ok := FromCSINode(l.driver, csiNode); ok {
			return id, nil
		}
		// A CSINode without the driver is what a node whose driver pod is gone looks like;
		// unpublish must still be possible then.
		err = fmt.Errorf("CSINode %s does not contain driver %s", nodeName, l.driver)
	}
	if detaching {
		if id, ok := va.Annotations[Annotation]; ok {
			return id, nil
		}
	}
	node, getErr := l.kube.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if getErr == nil {
		if id, ok := FromNode(l.driver, node); ok {
			return id, nil
		}
	}
	return "", err
}

// Cached is the node ID a VolumeAttachment is published with, from the CSINode cache and
// the VolumeAttachment only (no API read): the reconciler's.
func (l *Lookup) Cached(va *storagev1.VolumeAttachment) (string, error) {
	if csiNode, err := l.csiNodes.Get(va.Spec.NodeName); err == nil {
		if id, ok := FromCSINode(l.driver, csiNode); ok {
			return id, nil
		}
	}
	if id, ok := va.Annotations[Annotation]; ok {
		return id, nil
	}
	return "", fmt.Errorf("no node ID for node %s", va.Spec.NodeName)
}

// FromCSINode is the node ID the driver registered in a CSINode.
func FromCSINode(driver string, n *storagev1.CSINode) (string, bool) {
	for _, d := range n.Spec.Drivers {
		if d.Name == driver {
			return d.NodeID, true
		}
	}
	return "", false
}

// FromNode is the node ID in a Node's csi.volume.kubernetes.io/nodeid annotation, which
// kubelets wrote before CSINode existed.
func FromNode(driver string, n *corev1.Node) (string, bool) {
	raw, ok := n.Annotations[NodesAnnotation]
	if !ok {
		return "", false
	}
	ids := map[string]string{}
	if err := json.Unmarshal([]byte(raw), &ids); err != nil {
		return "", false
	}
	id, ok := ids[driver]
	return id, ok && id != ""
}
