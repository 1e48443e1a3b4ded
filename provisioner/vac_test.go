package provisioner

import (
	"context"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	fakediscovery "k8s.io/client-go/discovery/fake"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/component-base/featuregate"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The VolumeAttributesClass gate as upstream applies it at start, with retries of a
// failing discovery.
func TestVolumeAttributesClassFollowsTheAPIServerUnlessSetExplicitly(t *testing.T) {
	served := []*metav1.APIResourceList{{GroupVersion: "storage.k8s.io/v1", APIResources: []metav1.APIResource{
		{Name: "storageclasses", Kind: "StorageClass"}, {Name: "volumeattributesclasses", Kind: "VolumeAttributesClass"}}}}
	notServed := []*metav1.APIResourceList{{GroupVersion: "storage.k8s.io/v1", APIResources: []metav1.APIResource{
		{Name: "storageclasses", Kind: "StorageClass"}}}}
	for _, tc := range []struct {
		name      string
		resources []*metav1.APIResourceList
		gates     map[string]bool
		// fails is how many discovery requests fail before the API server answers; -1: all.
		fails int
		want  bool
		// wantAsked: the API server was asked.
		wantAsked bool
	}{
		{name: "served: on", resources: served, want: true, wantAsked: true},
		{name: "not served: off", resources: notServed, wantAsked: true},
		{name: "storage.k8s.io/v1 not served at all: off", wantAsked: true},
		{name: "set explicitly: on without asking", resources: notServed, gates: map[string]bool{"VolumeAttributesClass": true}, want: true},
		{name: "turned off: off without asking", resources: served, gates: map[string]bool{"VolumeAttributesClass": false}},
		{name: "discovery fails at first, then served: retried, on", resources: served, fails: 2, want: true, wantAsked: true},
		{name: "discovery fails at first, then not served: retried, off", resources: notServed, fails: 2, wantAsked: true},
		{name: "discovery keeps failing: left on, as upstream", resources: notServed, fails: -1, want: true, wantAsked: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			disc := fake.NewClientset().Discovery().(*fakediscovery.FakeDiscovery)
			disc.Resources = tc.resources
			asked, failed := 0, 0
			disc.PrependReactor("get", "resource", func(k8stesting.Action) (bool, runtime.Object, error) {
				asked++
				if tc.fails >= 0 && failed >= tc.fails {
					return false, nil, nil
				}
				failed++
				return true, nil, apierrors.NewServiceUnavailable("injected")
			})
			gates := featuregate.NewFeatureGate()
			if err := gates.Add(features()); err != nil {
				t.Fatal(err)
			}
			if err := gates.SetFromMap(tc.gates); err != nil {
				t.Fatal(err)
			}
			got := volumeAttributesClassEnabled(context.Background(), gates, disc, wait.Backoff{Duration: time.Millisecond, Factor: 1, Steps: 4})
			if got != tc.want {
				t.Errorf("enabled %v, want %v", got, tc.want)
			}
			if (asked > 0) != tc.wantAsked {
				t.Errorf("%d discovery requests, want some: %v", asked, tc.wantAsked)
			}
			if tc.fails > 0 && failed != tc.fails {
				t.Errorf("%d discovery requests failed, want %d before the answer", failed, tc.fails)
			}
		})
	}
}

// With the gate off (the API server has no v1 VolumeAttributesClass), a claim naming a
// class is provisioned without reading it, and its PersistentVolume names none: the
// claim's field is then ignored, as upstream ignores it.
func TestWithVolumeAttributesClassOffAClaimsClassIsIgnored(t *testing.T) {
	claim := claimFor("data", "uid-1", "fast")
	claim.Spec.VolumeAttributesClassName = ptr.To("gold")
	w := newWorld(t, testdriver.Config{}, func(c *config) { c.vac = false }, class("fast", nil), claim)
	w.waitFor("the PersistentVolume", func() bool { return w.pv("pvc-uid-1") != nil })
	if vac := w.pv("pvc-uid-1").Spec.VolumeAttributesClassName; vac != nil {
		t.Errorf("PersistentVolume names VolumeAttributesClass %q", *vac)
	}
	for _, a := range w.kube.Actions() {
		if a.GetResource().Resource == "volumeattributesclasses" {
			t.Errorf("the VolumeAttributesClass was read: %v", a)
		}
	}
}
