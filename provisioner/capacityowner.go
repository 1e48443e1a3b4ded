package provisioner

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// capacityManagedByFor is the managed-by label value of an instance: upstream's
// "external-provisioner", or "external-provisioner-<node>" for a node deployment, kept a
// valid label value (a long node name is shortened by a hash of it).
func capacityManagedByFor(nodeName string) string {
	if nodeName == "" {
		return capacityManagedBy
	}
	name := capacityManagedBy + "-" + nodeName
	if len(name) <= validation.LabelValueMaxLength {
		return name
	}
	sum := sha256.Sum256([]byte(nodeName))
	hash := hex.EncodeToString(sum[:])[:16]
	keep := validation.LabelValueMaxLength - len(capacityManagedBy) - len(hash) - 2
	return capacityManagedBy + "-" + nodeName[:keep] + "-" + hash
}

// lookupCapacityOwner returns the owner of the CSIStorageCapacity objects for
// --capacity-ownerref-level: the pod itself (0), its controller (1, e.g. a ReplicaSet or
// StatefulSet), that one's controller (2, e.g. a Deployment), and so on. It reads the
// objects on the way (pods get; replicasets, statefulsets, daemonsets, deployments, jobs
// get when the level walks through them).
func lookupCapacityOwner(ctx context.Context, kube kubernetes.Interface, namespace, podName string, level int) (*metav1.OwnerReference, error) {
	pod, err := kube.CoreV1().Pods(namespace).Get(ctx, podName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("--capacity-ownerref-level=%d: reading pod %s/%s (POD_NAME): %w", level, namespace, podName, err)
	}
	ref := metav1.OwnerReference{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID}
	meta := pod.ObjectMeta
	for i := 1; i <= level; i++ {
		controller := metav1.GetControllerOfNoCopy(&meta)
		if controller == nil {
			return nil, fmt.Errorf("--capacity-ownerref-level=%d: %s %s/%s has no controller (level %d)", level, ref.Kind, namespace, ref.Name, i)
		}
		ref = *controller
		if i == level {
			break
		}
		if meta, err = ownerMeta(ctx, kube, namespace, ref); err != nil {
			return nil, fmt.Errorf("--capacity-ownerref-level=%d: %w", level, err)
		}
	}
	ref.Controller = ptr.To(true)
	ref.BlockOwnerDeletion = nil
	return &ref, nil
}

// ownerMeta reads the metadata of an owner of the kinds a pod's controller chain has.
func ownerMeta(ctx context.Context, kube kubernetes.Interface, namespace string, ref metav1.OwnerReference) (metav1.ObjectMeta, error) {
	var (
		meta metav1.ObjectMeta
		err  error
	)
	get := metav1.GetOptions{}
	switch gv := ref.APIVersion + "/" + ref.Kind; gv {
	case "apps/v1/ReplicaSet":
		obj, e := kube.AppsV1().ReplicaSets(namespace).Get(ctx, ref.Name, get)
		if e == nil {
			meta = obj.ObjectMeta
		}
		err = e
	case "apps/v1/StatefulSet":
		obj, e := kube.AppsV1().StatefulSets(namespace).Get(ctx, ref.Name, get)
		if e == nil {
			meta = obj.ObjectMeta
		}
		err = e
	case "apps/v1/DaemonSet":
		obj, e := kube.AppsV1().DaemonSets(namespace).Get(ctx, ref.Name, get)
		if e == nil {
			meta = obj.ObjectMeta
		}
		err = e
	case "apps/v1/Deployment":
		obj, e := kube.AppsV1().Deployments(namespace).Get(ctx, ref.Name, get)
		if e == nil {
			meta = obj.ObjectMeta
		}
		err = e
	case "batch/v1/Job":
		obj, e := kube.BatchV1().Jobs(namespace).Get(ctx, ref.Name, get)
		if e == nil {
			meta = obj.ObjectMeta
		}
		err = e
	default:
		return meta, fmt.Errorf("owner %s %s/%s: walking through kind %s is not supported", ref.Kind, namespace, ref.Name, gv)
	}
	if err != nil {
		return meta, fmt.Errorf("reading %s %s/%s: %w", ref.Kind, namespace, ref.Name, err)
	}
	if meta.UID != ref.UID {
		return meta, fmt.Errorf("%s %s/%s has UID %s, its dependent names %s", ref.Kind, namespace, ref.Name, meta.UID, ref.UID)
	}
	return meta, nil
}
