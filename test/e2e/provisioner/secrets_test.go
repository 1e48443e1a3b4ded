package provisioner

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// A StorageClass naming a ControllerModifyVolume secret (templated like the others) is
// provisioned, the secret kept from the driver's parameters, and its PersistentVolume
// names the secret in upstream's annotations, which the resizer reads; a class without
// one gets no such annotations.
func TestTheModifySecretOfAClassIsRecordedOnThePersistentVolume(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	withSecret := s.createClass("modify", func(sc *storagev1.StorageClass) {
		sc.Parameters["csi.storage.k8s.io/controller-modify-secret-name"] = "${pvc.name}-modify"
		sc.Parameters["csi.storage.k8s.io/controller-modify-secret-namespace"] = "${pvc.namespace}"
	})
	plain := s.createClass("plain", nil)
	r := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	r.WaitReady(t)

	a := s.createClaim("a", withSecret.Name, "")
	b := s.createClaim("b", plain.Name, "")
	var pvA, pvB *v1.PersistentVolume
	s.WaitUntil("both PersistentVolumes", func() bool {
		byClaim := s.pvsByClaim()
		if len(byClaim[a.UID]) == 1 && len(byClaim[b.UID]) == 1 {
			pvA, pvB = byClaim[a.UID][0], byClaim[b.UID][0]
			return true
		}
		return false
	})
	const name, namespace = "volume.kubernetes.io/controller-modify-secret-name", "volume.kubernetes.io/controller-modify-secret-namespace"
	if pvA.Annotations[name] != "a-modify" || pvA.Annotations[namespace] != s.Namespace {
		t.Errorf("PV of the class with a modify secret: annotations %v, want %s/a-modify", pvA.Annotations, s.Namespace)
	}
	if _, ok := pvB.Annotations[name]; ok {
		t.Errorf("PV of the class without a modify secret: annotations %v", pvB.Annotations)
	}
	for _, v := range s.Driver.Volumes() {
		for k := range v.Parameters {
			if k != "type" {
				t.Errorf("volume %s got parameter %q", v.Name, k)
			}
		}
	}
	if events := s.events("a", "ProvisioningFailed"); len(events) > 0 {
		t.Errorf("ProvisioningFailed events: %v", events)
	}
}
