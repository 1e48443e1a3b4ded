package provisioner

import (
	"context"
	"fmt"
	"hash/fnv"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// capacityManagedByFor is the managed-by label value of an instance: upstream's
// "external-provisioner", or for a node deployment "external-provisioner-<node>" kept
// within a DNS label's 63 characters exactly as upstream shortens it (boundedName), so
// that objects written by upstream before a rolling upgrade are recognised (P9).
func capacityManagedByFor(nodeName string) string {
	if nodeName == "" {
		return capacityManagedBy
	}
	return boundedName(capacityManagedBy, nodeName, validation.DNS1035LabelMaxLength)
}

// boundedName is "<base>-<suffix>" when that fits in limit characters. Longer, it keeps
// as much of it as upstream's external-provisioner keeps, with the same 8-digit FNV-1a
// hashes (the values must match upstream's, P9): when the suffix leaves room, the base is
// cut and its hash follows it, "<base cut>-<hash of base>-<suffix>"; otherwise the suffix
// is dropped, "<base cut>-<hash of the whole name>", cut at limit.
func boundedName(base, suffix string, limit int) string {
	whole := suffix
	if base != "" {
		whole = base + "-" + suffix
	}
	if len(whole) <= limit {
		return whole
	}
	// Room for the base once two dashes and the hash are counted.
	if keep := limit - len(suffix) - 10; keep > 0 {
		return base[:keep] + "-" + fnv32aHex(base) + "-" + suffix
	}
	short := fnv32aHex(whole)
	if keep := min(len(base), max(0, limit-9)); keep > 0 {
		short = base[:keep] + "-" + short
	}
	return short[:min(limit, len(short))]
}

// fnv32aHex is the 32-bit FNV-1a hash of s in 8 hexadecimal digits.
func fnv32aHex(s string) string {
	h := fnv.New32a()
	h.Write([]byte(s))
	return fmt.Sprintf("%08x", h.Sum32())
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
