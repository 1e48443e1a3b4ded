package request

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
)

// The CSI driver csi-translation-lib migrates the in-tree kubernetes.io/aws-ebs plugin to.
const (
	ebsDriver = "ebs.csi.aws.com"
	ebsInTree = "kubernetes.io/aws-ebs"
)

func TestDriverNamesComeFromTheTranslationLibrary(t *testing.T) {
	if got := NamesOf(ebsDriver); got != (DriverNames{Driver: ebsDriver, InTree: ebsInTree}) {
		t.Errorf("names of %s: %+v", ebsDriver, got)
	}
	if got := NamesOf(drv); got != (DriverNames{Driver: drv}) {
		t.Errorf("names of %s: %+v, want no in-tree plugin", drv, got)
	}
}

// An in-tree PersistentVolume is the driver's when its source is of the plugin the driver
// replaces and it was provisioned by either name or migrated to the driver.
func TestInTreeVolumesOfTheReplacedPluginAreTheDrivers(t *testing.T) {
	ebs := NamesOf(ebsDriver)
	ebsSource := v1.PersistentVolumeSource{AWSElasticBlockStore: &v1.AWSElasticBlockStoreVolumeSource{VolumeID: "vol-1"}}
	pdSource := v1.PersistentVolumeSource{GCEPersistentDisk: &v1.GCEPersistentDiskVolumeSource{PDName: "disk"}}
	pv := func(source v1.PersistentVolumeSource, annotations ...string) *v1.PersistentVolume {
		p := &v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{}}, Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: source}}
		for i := 0; i+1 < len(annotations); i += 2 {
			p.Annotations[annotations[i]] = annotations[i+1]
		}
		return p
	}
	by, migratedTo := volumehelpers.AnnDynamicallyProvisioned, volumehelpers.AnnMigratedTo
	for _, tc := range []struct {
		name  string
		names DriverNames
		pv    *v1.PersistentVolume
		want  bool
	}{
		{"provisioned by the in-tree plugin", ebs, pv(ebsSource, by, ebsInTree), true},
		{"provisioned by the in-tree plugin, migrated", ebs, pv(ebsSource, by, ebsInTree, migratedTo, ebsDriver), true},
		{"provisioned by the driver", ebs, pv(ebsSource, by, ebsDriver), true},
		{"static, migrated to the driver", ebs, pv(ebsSource, migratedTo, ebsDriver), true},
		{"static, not migrated", ebs, pv(ebsSource), false},
		{"provisioned by another", ebs, pv(ebsSource, by, "other"), false},
		{"another plugin's volume naming the driver", ebs, pv(pdSource, by, ebsInTree, migratedTo, ebsDriver), false},
		{"a driver that replaces no plugin", DriverNames{Driver: drv}, pv(ebsSource, by, ebsInTree, migratedTo, drv), false},
	} {
		if got := IsDriverVolume(tc.pv, tc.names); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestDriverVolumes(t *testing.T) {
	for _, tc := range []struct {
		name string
		pv   v1.PersistentVolume
		want bool
	}{
		{"provisioned by the driver", v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{volumehelpers.AnnDynamicallyProvisioned: drv}},
			Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: drv}}}}, true},
		// drv replaces no in-tree plugin (migration_test.go has those that do).
		{"in-tree volume migrated to the driver", v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
			volumehelpers.AnnDynamicallyProvisioned: "kubernetes.io/gce-pd", volumehelpers.AnnMigratedTo: drv}},
			Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: v1.PersistentVolumeSource{GCEPersistentDisk: &v1.GCEPersistentDiskVolumeSource{PDName: "disk"}}}}, false},
		{"provisioned by another", v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{volumehelpers.AnnDynamicallyProvisioned: "other"}},
			Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: drv}}}}, false},
		{"static volume of the driver", v1.PersistentVolume{Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: drv}}}}, true},
		{"static volume of another", v1.PersistentVolume{Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{Driver: "x"}}}}, false},
	} {
		if got := IsDriverVolume(&tc.pv, DriverNames{Driver: drv}); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
