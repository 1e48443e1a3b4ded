package provisioner

// The provisioner runs with upstream's RBAC (external-provisioner v6.x,
// deploy/kubernetes/rbac.yaml), so every API write uses a verb that file grants for its
// resource:
//
//	persistentvolumes       create, patch, delete  (never update)
//	persistentvolumeclaims  update                 (never patch)
//	volumesnapshots         update                 (v6.2 on; v6.0 and v6.1 grant get, list only)
//	csistoragecapacities    create, update, patch, delete
//	events                  create, update, patch
//
// What upstream's RBAC of some v6 release does not grant degrades the feature it serves,
// with one warning in the log, and never fails the work: without update on
// volumesnapshots a restore goes on without source protection, without watch on them the
// snapshot cache is refreshed by relisting.
