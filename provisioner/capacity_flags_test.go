package provisioner

import (
	"strings"
	"testing"
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
