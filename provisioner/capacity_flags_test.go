package provisioner

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
)

func TestCapacityFlagsNeedTheirEnvironment(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
	}{
		{"namespace missing", []string{"--enable-capacity"}, map[string]string{"POD_NAME": "p"}, "NAMESPACE"},
		{"pod missing for an owner", []string{"--enable-capacity"}, map[string]string{"NAMESPACE": "ns"}, "POD_NAME"},
		{"no owner needs no pod", []string{"--enable-capacity", "--capacity-ownerref-level=-1"}, map[string]string{"NAMESPACE": "ns"}, ""},
		{"older upstream's POD_NAMESPACE", []string{"--enable-capacity", "--capacity-ownerref-level=0"}, map[string]string{"POD_NAMESPACE": "ns", "POD_NAME": "p"}, ""},
		// Upstream accepts these two; a warning says what they do.
		{"poll interval", []string{"--enable-capacity", "--capacity-poll-interval=0"}, map[string]string{"NAMESPACE": "ns", "POD_NAME": "p"}, ""},
		{"threads", []string{"--enable-capacity", "--capacity-threads=0"}, map[string]string{"NAMESPACE": "ns", "POD_NAME": "p"}, ""},
		{"burst without qps", []string{"--enable-capacity", "--kube-api-capacity-qps=1", "--kube-api-capacity-burst=0"}, map[string]string{"NAMESPACE": "ns", "POD_NAME": "p"}, "--kube-api-capacity-burst"},
		{"capacity off needs nothing", nil, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var o options
			if err := newFlagSet(&o).Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			err := o.validate(func(k string) string { return tc.env[k] })
			if (tc.wantErr == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.wantErr)) {
				t.Errorf("validate: %v, want %q", err, tc.wantErr)
			}
		})
	}
}

func TestVolumeTopology(t *testing.T) {
	pv := &v1.PersistentVolume{Spec: v1.PersistentVolumeSpec{NodeAffinity: &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{
		{MatchExpressions: []v1.NodeSelectorRequirement{{Key: "zone", Operator: v1.NodeSelectorOpIn, Values: []string{"a"}}}},
	}}}}}
	if got := volumeTopology(pv); len(got) != 1 || !cmp.Equal(got[0].GetSegments(), map[string]string{"zone": "a"}) {
		t.Errorf("volumeTopology: %v, want zone=a", got)
	}
	pv.Spec.NodeAffinity.Required.NodeSelectorTerms[0].MatchExpressions[0].Values = []string{"a", "b"}
	if got := volumeTopology(pv); got != nil {
		t.Errorf("volumeTopology of a multi-value term: %v, want nil (every segment)", got)
	}
}
