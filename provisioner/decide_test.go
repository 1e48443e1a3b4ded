package provisioner

import (
	"errors"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/spf13/pflag"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/record"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

func TestWantsVolume(t *testing.T) {
	immediate := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "sc"}, Provisioner: drv}
	delayed := immediate.DeepCopy()
	delayed.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	claim := func(change func(*v1.PersistentVolumeClaim)) *v1.PersistentVolumeClaim {
		c := claimWith("1Gi", v1.ReadWriteOnce)
		c.Annotations = map[string]string{volumehelpers.AnnStorageProvisioner: drv}
		if change != nil {
			change(c)
		}
		return c
	}
	for _, tc := range []struct {
		name  string
		claim *v1.PersistentVolumeClaim
		class *storagev1.StorageClass
		want  bool
	}{
		{"immediate: at once", claim(nil), immediate, true},
		{"beta annotation", claim(func(c *v1.PersistentVolumeClaim) {
			c.Annotations = map[string]string{volumehelpers.AnnBetaStorageProvisioner: drv}
		}), immediate, true},
		{"another provisioner", claim(func(c *v1.PersistentVolumeClaim) { c.Annotations[volumehelpers.AnnStorageProvisioner] = "other" }), immediate, false},
		{"no annotation", claim(func(c *v1.PersistentVolumeClaim) { c.Annotations = nil }), immediate, false},
		{"bound", claim(func(c *v1.PersistentVolumeClaim) { c.Spec.VolumeName = "pv" }), immediate, false},
		{"being deleted", claim(func(c *v1.PersistentVolumeClaim) { c.DeletionTimestamp = &metav1.Time{} }), immediate, false},
		{"class of another provisioner", claim(nil), &storagev1.StorageClass{Provisioner: "other"}, false},
		{"no class", claim(nil), nil, false},
		{"delayed without node", claim(nil), delayed, false},
		{"delayed with node", claim(func(c *v1.PersistentVolumeClaim) { c.Annotations[volumehelpers.AnnSelectedNode] = "n1" }), delayed, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got, why := wantsVolume(tc.claim, tc.class, request.DriverNames{Driver: drv}); got != tc.want {
				t.Errorf("wants %v (%s), want %v", got, why, tc.want)
			}
		})
	}
}

func TestCreateVolumeErrorsThatMayLeaveAVolumeAreRetriedWithTheSameName(t *testing.T) {
	for _, tc := range []struct {
		err           error
		mayReschedule bool
		want          createOutcome
	}{
		{status.Error(codes.DeadlineExceeded, ""), false, createInBackground},
		{status.Error(codes.Canceled, ""), true, createInBackground},
		{status.Error(codes.Unavailable, ""), false, createInBackground},
		{status.Error(codes.Aborted, ""), false, createInBackground},
		{errors.New("not a gRPC error"), false, createInBackground},
		{status.Error(codes.ResourceExhausted, ""), true, createReschedule},
		{status.Error(codes.ResourceExhausted, ""), false, createFinal},
		{status.Error(codes.InvalidArgument, ""), true, createFinal},
		{status.Error(codes.AlreadyExists, ""), false, createFinal},
		{status.Error(codes.Internal, ""), false, createFinal},
		{status.Error(codes.NotFound, ""), false, createFinal},
	} {
		if got := classifyCreateError(tc.err, tc.mayReschedule); got != tc.want {
			t.Errorf("%v (may reschedule %v): %s, want %s", tc.err, tc.mayReschedule, got, tc.want)
		}
	}
}

func TestFlagsHaveUpstreamDefaultsAndBadValuesNameTheirFlag(t *testing.T) {
	var o options
	fs := newFlagSet(&o)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	defaults := map[string]string{
		"volume-name-prefix": "pvc", "volume-name-uuid-length": "-1", "timeout": "10s", "worker-threads": "100",
		"retry-interval-start": "1s", "retry-interval-max": "5m0s", "extra-create-metadata": "false", "default-fstype": "",
		"strict-topology": "false", "immediate-topology": "true", "controller-publish-readonly": "false",
		"prevent-volume-mode-conversion": "true", "node-deployment": "false", "node-deployment-immediate-binding": "true",
		"node-deployment-base-delay": "20s", "node-deployment-max-delay": "1m0s", "cloning-protection-threads": "1",
		"enable-capacity": "false", "capacity-threads": "1", "capacity-poll-interval": "1m0s",
		"capacity-for-immediate-binding": "false", "capacity-ownerref-level": "1", "snapshot-orphan-sweep-interval": "5m0s",
	}
	for name, want := range defaults {
		f := fs.Lookup(name)
		if f == nil {
			t.Errorf("flag --%s missing", name)
			continue
		}
		if f.DefValue != want {
			t.Errorf("--%s defaults to %q, want %q", name, f.DefValue, want)
		}
	}
	if err := o.validate(func(string) string { return "" }); err != nil {
		t.Errorf("defaults do not validate: %v", err)
	}
	for _, tc := range []struct {
		args []string
		env  string
		want string
	}{
		{[]string{"--volume-name-uuid-length=0"}, "", "--volume-name-uuid-length"},
		{[]string{"--volume-name-uuid-length=40"}, "", "--volume-name-uuid-length"},
		// Upstream accepts these; a warning says what they do.
		{[]string{"--volume-name-prefix="}, "", ""},
		{[]string{"--timeout=0s"}, "", ""},
		{[]string{"--worker-threads=0"}, "", ""},
		{[]string{"--retry-interval-max=10ms"}, "", ""},
		{[]string{"--snapshot-orphan-sweep-interval=0"}, "", ""},
		{[]string{"--node-deployment"}, "", "NODE_NAME"},
		{[]string{"--node-deployment"}, "node-1", ""},
	} {
		var o options
		fs := newFlagSet(&o)
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		err := o.validate(func(string) string { return tc.env })
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
	}
}

// newFlagSet registers the options on a flag set of their own.
func newFlagSet(o *options) *pflag.FlagSet {
	fs := pflag.NewFlagSet("provisioner", pflag.ContinueOnError)
	o.addFlags(fs)
	return fs
}

// P9: the Lease is upstream's (the driver name, sanitised), so an upstream replica and ours
// never lead at once during a rolling upgrade.
func TestLeaseIsUpstreamsDriverName(t *testing.T) {
	if got := lifecycle.SanitizeName(New().LeaseName("csi.example.com")); got != "csi-example-com" {
		t.Errorf("Lease %q, want csi-example-com", got)
	}
}

func TestWhatARecordAsksFor(t *testing.T) {
	// kube-controller-manager's hand-over of a claim of an in-tree class.
	migratedClaim := func(c *v1.PersistentVolumeClaim) {
		c.Annotations[volumehelpers.AnnStorageProvisioner] = ebsInTree
		c.Annotations[volumehelpers.AnnMigratedTo] = drv
	}
	onNode := func(node string) func(*v1.PersistentVolumeClaim) {
		return func(c *v1.PersistentVolumeClaim) {
			if node == "" {
				delete(c.Annotations, volumehelpers.AnnSelectedNode)
				return
			}
			c.Annotations[volumehelpers.AnnSelectedNode] = node
		}
	}
	name := "pvc-" + decideUID
	for _, tc := range []struct {
		what string
		// claim changes the recorded claim; gone drops it.
		claim     func(*v1.PersistentVolumeClaim)
		gone      bool
		recNode   string
		recDriver string
		noRecord  bool
		recErr    error
		// memory: the record is this process's own.
		memory bool
		node   string
		// inTree: the driver replaces this in-tree plugin (CSI migration).
		inTree   string
		wantName string
		pv       bool
		want     recordAction
		why      string
	}{
		{what: "no record", noRecord: true, want: recordNone},
		{what: "unreadable", recErr: errors.New("bad"), want: recordUntrusted, why: "bad"},
		{what: "another driver's", recDriver: "other.example.com", want: recordSkip},
		{what: "another node's in a node deployment", node: "n2", recNode: "n1", claim: onNode("n1"), want: recordSkip},
		{what: "a name not of the claim's UID", claim: func(c *v1.PersistentVolumeClaim) { c.UID = "11111111-2222-3333-4444-555555555555" }, want: recordUntrusted, why: "not made from the claim's UID"},
		{what: "this process's own, claim cache behind", memory: true, claim: func(c *v1.PersistentVolumeClaim) { c.UID = "11111111-2222-3333-4444-555555555555" }, want: recordFinish},
		{what: "PersistentVolume saved", pv: true, claim: func(c *v1.PersistentVolumeClaim) { c.DeletionTimestamp = ptr.To(metav1.Now()) }, want: recordDrop},
		{what: "claim gone", memory: true, gone: true, want: recordUndo, why: "gone"},
		{what: "claim deleted", claim: func(c *v1.PersistentVolumeClaim) { c.DeletionTimestamp = ptr.To(metav1.Now()) }, want: recordUndo, why: "being deleted"},
		{what: "another provisioner", claim: func(c *v1.PersistentVolumeClaim) { c.Annotations[volumehelpers.AnnStorageProvisioner] = "other" }, want: recordUndo, why: `provisioner "other"`},
		{what: "handed over under the in-tree name (CSI migration)", inTree: ebsInTree, claim: migratedClaim, want: recordFinish},
		{what: "the in-tree name of a plugin the driver does not replace", claim: migratedClaim, want: recordUndo, why: `provisioner "` + ebsInTree},
		{what: "bound elsewhere", claim: func(c *v1.PersistentVolumeClaim) { c.Spec.VolumeName = "static-pv" }, want: recordUndo, why: "bound to PersistentVolume static-pv"},
		{what: "bound to its volume", claim: func(c *v1.PersistentVolumeClaim) { c.Spec.VolumeName = name }, want: recordFinish},
		{what: "rescheduled to another node", recNode: "n1", claim: onNode("n2"), want: recordUndo, why: "from node n1 to n2"},
		{what: "handed back to the scheduler", recNode: "n1", claim: onNode(""), want: recordUndo, why: "away from node n1"},
		{what: "a node selected since", claim: onNode("n1"), want: recordUndo, why: "selects node n1 since"},
		{what: "same node", recNode: "n1", claim: onNode("n1"), want: recordFinish},
		{what: "name flags changed", wantName: "vol-0f1e2d3c", want: recordUndo, why: "named vol-0f1e2d3c"},
		{what: "still wanted", wantName: name, want: recordFinish},
	} {
		t.Run(tc.what, func(t *testing.T) {
			rec := decideRecordOf(t, tc.recNode)
			if tc.recDriver != "" {
				rec.Driver = tc.recDriver
			}
			claim := decideClaim(t, rec, tc.claim)
			f := recordFacts{claim: claim, rec: rec, recErr: tc.recErr, fromMemory: tc.memory, driver: drv, inTree: tc.inTree, node: tc.node,
				wantName: tc.wantName, minCut: -1, pvExists: tc.pv}
			if tc.noRecord {
				f.rec = nil
			}
			if tc.gone {
				f.claim = nil
			}
			got, why := decideRecord(f)
			if got != tc.want || !strings.Contains(why, tc.why) {
				t.Errorf("decideRecord = %s (%q), want %s (%q)", got, why, tc.want, tc.why)
			}
		})
	}
}

const decideUID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"

// decideRecordOf is a record of the claim of decideUID, selecting node.
func decideRecordOf(t *testing.T, node string) *record.Record {
	t.Helper()
	r, err := record.New(drv, node, nil, &csi.CreateVolumeRequest{Name: "pvc-" + decideUID})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// decideClaim is the claim of decideUID, carrying rec as an earlier version did.
func decideClaim(t *testing.T, rec *record.Record, change func(*v1.PersistentVolumeClaim)) *v1.PersistentVolumeClaim {
	t.Helper()
	value, err := rec.Encode()
	if err != nil {
		t.Fatal(err)
	}
	c := record.With(claimFor("data", decideUID, "fast"), value)
	if change != nil {
		change(c)
	}
	return c
}

func TestVolumeNamesThatCanBeAClaims(t *testing.T) {
	for _, tc := range []struct {
		name   string
		minCut int
		want   bool
	}{
		{"pvc-" + decideUID, 8, true},
		{"other-prefix-" + decideUID, 8, true},
		{"pvc-0f1e2d3c4b5a", 8, true},
		{"pvc-0f1e2d3c", 8, true},
		{"pvc-0f1e", 8, false},
		{"pvc-0f1e", 4, true},
		{"pvc-0f1f2d3c4b5a", 8, false},
		{"pvc-11111111-2222-3333-4444-555555555555", 8, false},
		{decideUID, 8, false},
		{"-" + decideUID, 8, false},
		{"pvc-", 8, false},
	} {
		if got := volumeOfClaim(tc.name, decideUID, tc.minCut); got != tc.want {
			t.Errorf("volumeOfClaim(%q, min %d) = %v, want %v", tc.name, tc.minCut, got, tc.want)
		}
	}
}
