package sources

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

const (
	drv = "drv.example.com"
	// ebsDriver replaces the in-tree plugin ebsInTree (csi-translation-lib).
	ebsDriver = "ebs.csi.aws.com"
	ebsInTree = "kubernetes.io/aws-ebs"
)

func TestASourceClaimBelongsToTheDriverOfItsVolumeElseOfItsProvisionerOrClass(t *testing.T) {
	annotated := func(p string) *v1.PersistentVolumeClaim {
		c := objects.ClaimFor(drv, "c", "u", "fast")
		c.Annotations = map[string]string{}
		if p != "" {
			c.Annotations[volumehelpers.AnnStorageProvisioner] = p
		}
		return c
	}
	pvOf := func(d string) *v1.PersistentVolume {
		return &v1.PersistentVolume{Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: d}}}}
	}
	classOf := func(p string) *storagev1.StorageClass {
		return objects.Class(drv, "fast", func(sc *storagev1.StorageClass) { sc.Provisioner = p })
	}
	for _, tc := range []struct {
		name  string
		claim *v1.PersistentVolumeClaim
		pv    *v1.PersistentVolume
		class *storagev1.StorageClass
		want  bool
	}{
		{"bound to the driver's volume", annotated("other"), pvOf(drv), classOf("other"), true},
		{"bound to another driver's volume", annotated(drv), pvOf("other"), classOf(drv), false},
		{"bound to an in-tree volume", annotated(drv), &v1.PersistentVolume{}, classOf(drv), false},
		{"unbound, names the driver", annotated(drv), nil, classOf("other"), true},
		{"unbound, names another", annotated("other"), nil, classOf(drv), false},
		{"unannotated, class of the driver", annotated(""), nil, classOf(drv), true},
		{"unannotated, class of another", annotated(""), nil, classOf("other"), false},
		{"nothing known", annotated(""), nil, nil, false},
	} {
		if got := claimOfDriver(tc.claim, tc.pv, tc.class, request.DriverNames{Driver: drv}); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
	// CSI migration: the in-tree volumes, provisioner and class of the replaced plugin.
	ebs := request.NamesOf(ebsDriver)
	ebsPV := &v1.PersistentVolume{Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: v1.PersistentVolumeSource{
		AWSElasticBlockStore: &v1.AWSElasticBlockStoreVolumeSource{VolumeID: "vol-1"}}}}
	handedOver := annotated(ebsInTree)
	handedOver.Annotations[volumehelpers.AnnMigratedTo] = ebsDriver
	for _, tc := range []struct {
		name  string
		claim *v1.PersistentVolumeClaim
		pv    *v1.PersistentVolume
		class *storagev1.StorageClass
		want  bool
	}{
		{"bound to an in-tree volume of the replaced plugin", annotated(""), ebsPV, nil, true},
		{"bound to another plugin's in-tree volume", annotated(ebsDriver), &v1.PersistentVolume{}, nil, false},
		{"unbound, handed over under the in-tree name", handedOver, nil, nil, true},
		{"unbound, the in-tree name alone", annotated(ebsInTree), nil, nil, false},
		{"unannotated, class of the in-tree plugin", annotated(""), nil, classOf(ebsInTree), true},
	} {
		if got := claimOfDriver(tc.claim, tc.pv, tc.class, ebs); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
