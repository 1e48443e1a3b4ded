package realloop

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cluster"
)

// write is an audit event of a write, for countWrites' tests.
func write(t *testing.T, at time.Time, agent, verb, resource, namespace, name string, code int, body any) audit.Event {
	t.Helper()
	var e audit.Event
	raw, err := json.Marshal(map[string]any{
		"verb": verb, "userAgent": agent, "requestReceivedTimestamp": at,
		"objectRef":      map[string]string{"resource": resource, "namespace": namespace, "name": name},
		"responseStatus": map[string]int{"code": code},
		"requestObject":  body,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &e); err != nil {
		t.Fatal(err)
	}
	return e
}

// The writes of a claim's life are split by sidecar (user agent; for our events, their
// source) and by operation (the object written and whether the claim or Pod was deleted
// then); other clients' writes, Lease writes and writes outside the window are left out.
func TestCountWritesSplitsBySidecarAndOperation(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	const ns, driver = "ns", "ns.csi.test"
	items := []cluster.Item{
		{Name: "a", PersistentVolume: "pvc-a", VolumeAttachment: "csi-a", Times: map[cluster.Stage]time.Time{
			cluster.Provisioned: at(2), cluster.Attached: at(4), cluster.GrowRequested: at(5), cluster.Grown: at(6),
			cluster.PodDeleted: at(10), cluster.Detached: at(11), cluster.ClaimDeleted: at(12), cluster.VolumeDeleted: at(14)}},
		{Name: "b", PersistentVolume: "pvc-b", VolumeAttachment: "csi-b", Times: map[cluster.Stage]time.Time{
			cluster.Provisioned: at(2), cluster.Attached: at(4)}},
		// Given a new VolumeAttributesClass at 5, grown after its modification at 8.
		{Name: "c", PersistentVolume: "pvc-c", Times: map[cluster.Stage]time.Time{
			cluster.Provisioned: at(2), cluster.Attached: at(4), cluster.ModifyRequested: at(5), cluster.Modified: at(6),
			cluster.GrowRequested: at(8), cluster.Grown: at(9)}},
	}
	claimEvent := map[string]any{"involvedObject": map[string]string{"kind": "PersistentVolumeClaim", "namespace": ns, "name": "a"},
		"source": map[string]string{"component": driver + "_provisioner"}}
	resizeEvent := map[string]any{"involvedObject": map[string]string{"kind": "PersistentVolumeClaim", "namespace": ns, "name": "a"},
		"source": map[string]string{"component": "external-resizer " + driver}}
	modifyEvent := map[string]any{"involvedObject": map[string]string{"kind": "PersistentVolumeClaim", "namespace": ns, "name": "c"},
		"source": map[string]string{"component": "external-resizer " + driver}}
	events := []audit.Event{
		write(t, at(-5), "csi-sidecars/provisioner", "update", "persistentvolumeclaims", ns, "a", 200, nil), // before the window
		write(t, at(1), "csi-sidecars/provisioner", "update", "persistentvolumeclaims", ns, "a", 200, nil),
		write(t, at(1), "csi-sidecars/provisioner", "create", "persistentvolumes", "", "pvc-a", 201, nil),
		write(t, at(1), "csi-sidecars/provisioner", "create", "persistentvolumes", "", "pvc-b", 201, nil),
		write(t, at(2), "csi-sidecars", "create", "events", ns, "a.1", 201, claimEvent),
		write(t, at(2), "csi-sidecars", "patch", "events", ns, "a.1", 200, map[string]any{"count": 2}),
		write(t, at(2), "csi-sidecars/provisioner", "update", "persistentvolumeclaims", ns, "b", 409, nil),
		write(t, at(3), "csi-sidecars/attacher", "patch", "volumeattachments", "", "csi-a", 200, nil),
		write(t, at(3), "csi-sidecars/attacher", "patch", "persistentvolumes", "", "pvc-a", 200, nil),
		write(t, at(5), "csi-sidecars/resizer", "patch", "persistentvolumeclaims/status", ns, "a", 200, nil),
		write(t, at(5), "csi-sidecars", "create", "events", ns, "a.2", 201, resizeEvent),
		write(t, at(5), "csi-sidecars/resizer", "patch", "persistentvolumeclaims/status", ns, "c", 409, nil),
		write(t, at(5), "csi-sidecars/resizer", "patch", "persistentvolumeclaims/status", ns, "c", 200, nil),
		write(t, at(5), "csi-sidecars", "create", "events", ns, "c.1", 201, modifyEvent),
		write(t, at(6), "csi-sidecars/resizer", "patch", "persistentvolumes", "", "pvc-c", 200, nil),
		write(t, at(8), "csi-sidecars/resizer", "patch", "persistentvolumeclaims/status", ns, "c", 200, nil),
		write(t, at(10), "csi-sidecars/attacher", "patch", "volumeattachments", "", "csi-a", 404, nil),
		write(t, at(13), "csi-sidecars/provisioner", "delete", "persistentvolumes", "", "pvc-a", 200, nil),
		write(t, at(13), "csi-sidecars/provisioner", "update", "leases", ns, "x", 200, nil),
		write(t, at(13), "kube-controller-manager/v1.37.2", "update", "persistentvolumes", "", "pvc-a", 200, nil),
		write(t, at(13), "csi-sidecars/provisioner", "create", "events", "default", "elsewhere.1", 201,
			map[string]any{"involvedObject": map[string]string{"kind": "PersistentVolume", "name": "pvc-z"}}),
	}
	got := countWrites(events, at(0), at(20), attribution{impl: ours, namespace: ns, driver: driver, items: items})
	want := map[opKey]struct{ ops, writes, conflicts, notFound int }{
		{"provisioner", "provision"}: {3, 6, 1, 0},
		{"provisioner", "delete"}:    {1, 1, 0, 0},
		{"attacher", "attach"}:       {3, 2, 0, 0},
		{"attacher", "detach"}:       {1, 1, 0, 1},
		{"resizer", "expand"}:        {2, 3, 0, 0},
		{"resizer", "modify"}:        {1, 4, 1, 0},
		{"provisioner", "other"}:     {0, 1, 0, 0},
	}
	for k, w := range want {
		c := got[k]
		if c == nil {
			t.Errorf("%v: nothing counted", k)
			continue
		}
		if c.Ops != w.ops || c.Writes != w.writes || c.Failed[409] != w.conflicts || c.Failed[404] != w.notFound {
			t.Errorf("%v: %d ops, %d writes, failed %v (kinds %s); want %d ops, %d writes, %d conflicts, %d not found",
				k, c.Ops, c.Writes, c.Failed, c.Kinds(), w.ops, w.writes, w.conflicts, w.notFound)
		}
	}
	if len(got) != len(want) {
		t.Errorf("counted %d keys, want %d: %v", len(got), len(want), got)
	}

	// Upstream's binaries are told apart by their user agents; ours are then nobody's.
	up := implementation{name: "upstream", binaries: map[string]string{"provisioner": "/x"}}
	events = []audit.Event{
		write(t, at(1), "csi-provisioner/v0.0.0 (linux/amd64) kubernetes/$Format", "create", "persistentvolumes", "", "pvc-a", 201, nil),
		write(t, at(1), "csi-provisioner/v0.0.0 (linux/amd64) kubernetes/$Format", "create", "events", ns, "a.1", 201, claimEvent),
		write(t, at(3), "csi-attacher/v0.0.0 (linux/amd64) kubernetes/$Format", "patch", "volumeattachments", "", "csi-a", 200, nil),
		write(t, at(1), "csi-sidecars/provisioner", "create", "persistentvolumes", "", "pvc-b", 201, nil),
	}
	got = countWrites(events, at(0), at(20), attribution{impl: up, namespace: ns, driver: driver, items: items})
	if c := got[opKey{"provisioner", "provision"}]; c == nil || c.Writes != 2 {
		t.Errorf("upstream provision: %+v, want 2 writes", c)
	}
	if c := got[opKey{"attacher", "attach"}]; c == nil || c.Writes != 1 {
		t.Errorf("upstream attach: %+v, want 1 write", c)
	}
}
