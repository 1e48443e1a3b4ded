package capacity

import (
	"context"
	"fmt"
	"hash/fnv"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/utils/ptr"
)

// ManagedByFor is the managed-by label value of an instance: upstream's
// "external-provisioner", or for a node deployment "external-provisioner-<node>" kept
// within a DNS label's 63 characters exactly as upstream shortens it (boundedName), so
// that objects written by upstream before a rolling upgrade are recognised (P9).
func ManagedByFor(nodeName string) string {
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

// OwnerReader reads the metadata of an owner of any kind: the RESTMapper (discovery) names
// its resource, the metadata client reads it. Like upstream's controller-runtime client,
// it needs get on that resource: upstream's RBAC grants it for pods and replicasets, any
// other kind on the way is the user's to grant.
type OwnerReader struct {
	mapper   meta.RESTMapper
	metadata metadata.Interface
}

// NewOwnerReader builds the reader on the sidecar's client configuration; discovery is
// asked only when the walk reads an owner.
func NewOwnerReader(rc *rest.Config, disc discovery.DiscoveryInterface) (*OwnerReader, error) {
	md, err := metadata.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("creating the metadata client for --capacity-ownerref-level: %w", err)
	}
	return &OwnerReader{mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc)), metadata: md}, nil
}

// read returns the metadata of the object ref names, in namespace unless its kind is
// cluster-scoped.
func (r *OwnerReader) read(ctx context.Context, namespace string, ref metav1.OwnerReference) (*metav1.ObjectMeta, error) {
	gv, err := schema.ParseGroupVersion(ref.APIVersion)
	if err != nil {
		return nil, fmt.Errorf("owner %s %s: parsing its apiVersion: %w", ref.Kind, ref.Name, err)
	}
	mapping, err := r.mapper.RESTMapping(gv.WithKind(ref.Kind).GroupKind(), gv.Version)
	if err != nil {
		return nil, fmt.Errorf("owner %s %s: finding the resource of kind %s: %w", ref.Kind, ref.Name, gv.WithKind(ref.Kind), err)
	}
	var client metadata.ResourceInterface = r.metadata.Resource(mapping.Resource)
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		client = r.metadata.Resource(mapping.Resource).Namespace(namespace)
	}
	obj, err := client.Get(ctx, ref.Name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("reading %s %s/%s: %w", ref.Kind, namespace, ref.Name, err)
	}
	return &obj.ObjectMeta, nil
}

// LookupOwner returns the owner of the CSIStorageCapacity objects for
// --capacity-ownerref-level: the pod itself (0), its controller (1, e.g. a ReplicaSet or
// StatefulSet), that one's controller (2, e.g. a Deployment), and so on, whatever their
// kinds, as upstream's owner.Lookup. It reads the pod, and each owner on the way but the
// last, whose reference its dependent holds.
func LookupOwner(ctx context.Context, kube kubernetes.Interface, owners *OwnerReader, namespace, podName string, level int) (*metav1.OwnerReference, error) {
	pod, err := kube.CoreV1().Pods(namespace).Get(ctx, podName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("--capacity-ownerref-level=%d: reading pod %s/%s (POD_NAME): %w", level, namespace, podName, err)
	}
	ref := metav1.OwnerReference{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID}
	current := &pod.ObjectMeta
	for i := 1; i <= level; i++ {
		owner := metav1.GetControllerOfNoCopy(current)
		if owner == nil {
			return nil, fmt.Errorf("--capacity-ownerref-level=%d: %s %s/%s has no controller (level %d)", level, ref.Kind, namespace, ref.Name, i)
		}
		ref = *owner
		if i == level {
			break
		}
		if current, err = owners.read(ctx, namespace, ref); err != nil {
			return nil, fmt.Errorf("--capacity-ownerref-level=%d: %w", level, err)
		}
		if current.UID != ref.UID {
			return nil, fmt.Errorf("--capacity-ownerref-level=%d: %s %s/%s has UID %s, its dependent names %s", level, ref.Kind, namespace, ref.Name, current.UID, ref.UID)
		}
	}
	ref.Controller = ptr.To(true)
	ref.BlockOwnerDeletion = nil
	return &ref, nil
}
