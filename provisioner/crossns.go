// Data sources in another namespace than the claim (CrossNamespaceVolumeDataSource): which
// claims may use them (sourceAccess), and the claims woken when a grant changes.

package provisioner

import (
	"fmt"

	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/provisioner/refgrant"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// claimSourceNamespaceIndex indexes the claims that clone a claim or restore a snapshot by
// the namespace of that source: the users of a source (SourceUser), and the claims a
// grant of a namespace concerns, are found among them, whatever their own namespace.
const claimSourceNamespaceIndex = "csi-sidecars-provisioner-source-namespace"

func claimSourceNamespace(obj any) ([]string, error) {
	claim, ok := obj.(*v1.PersistentVolumeClaim)
	if !ok {
		return nil, nil
	}
	ref, err := request.ClaimSource(claim)
	if err != nil || ref.Kind == request.SourceNone {
		return nil, nil
	}
	return []string{ref.Namespace}, nil
}

// sourceAccess says whether a claim may use a data source of another namespace: only with
// the gate on, and while a ReferenceGrant in the source's namespace allows it.
type sourceAccess struct {
	// grants is nil with the gate off.
	grants *refgrant.Watch
}

// check returns why the claim may not use ref, nil when it may (always for a source of
// its own namespace).
func (a sourceAccess) check(claim *v1.PersistentVolumeClaim, ref request.SourceRef) error {
	if ref.Kind == request.SourceNone || ref.Namespace == claim.Namespace {
		return nil
	}
	if a.grants == nil {
		// Upstream's words: the API server kept the namespace, this provisioner's gate is off.
		return fmt.Errorf("dataSourceRef namespace specified but the %s feature is disabled", CrossNamespaceVolumeDataSource)
	}
	to := grantTarget(ref)
	if err := a.grants.Check(claim.Namespace, to); err != nil {
		return fmt.Errorf("accessing %s from claim %s is not allowed: %w", to, klog.KObj(claim), err)
	}
	return nil
}

// grantTarget is the object a ReferenceGrant must name for ref.
func grantTarget(ref request.SourceRef) refgrant.Target {
	t := refgrant.Target{Namespace: ref.Namespace, Kind: request.PVCKind, Name: ref.Name}
	if ref.Kind == request.SourceSnapshot {
		t.Group, t.Kind = request.SnapshotAPIGroup, request.SnapshotKind
	}
	return t
}

// wakeOnGrant is what a ReferenceGrant's change in a namespace does: it queues, through
// enqueue and at once, the claims of other namespaces whose data source is there (found
// in claims by claimSourceNamespaceIndex), so that a grant that appears is acted on
// without waiting out their backoff.
func wakeOnGrant(claims cache.Indexer, enqueue func(obj any)) func(namespace string) {
	return func(namespace string) {
		objs, err := claims.ByIndex(claimSourceNamespaceIndex, namespace)
		if err != nil {
			klog.Background().Error(err, "Cannot find the claims a ReferenceGrant concerns", "namespace", namespace)
			return
		}
		for _, obj := range objs {
			if claim, ok := obj.(*v1.PersistentVolumeClaim); ok && claim.Namespace != namespace {
				enqueue(claim)
			}
		}
	}
}
