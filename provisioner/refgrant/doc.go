// Package refgrant is the provisioner's reading of Gateway API ReferenceGrants
// (gateway.networking.k8s.io/v1beta1), which let a claim take its data source from another
// namespace (the CrossNamespaceVolumeDataSource gate, KEP-3294): a VolumeSnapshot or a
// PersistentVolumeClaim in namespace N may be the source of a claim of namespace M only
// while a ReferenceGrant in N allows PersistentVolumeClaims of M to refer to that kind (and
// name, if the grant names one).
//
// Allows is the decision, a plain function tested by a table. The Watch owns the grants'
// informer: it never holds the provisioner back (a cluster without the ReferenceGrant CRD,
// or an RBAC without list and watch on referencegrants, still provisions every claim of
// its own namespace's sources), it says what is missing, in the log and to every
// cross-namespace claim it refuses, and it tells the provisioner at once of every grant
// that appears, changes or goes, so the claims waiting on one do not wait for their
// backoff. It writes nothing.
package refgrant
