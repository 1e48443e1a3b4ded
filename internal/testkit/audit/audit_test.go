package audit

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A log of three requests: a write logged at two stages (the later one counts), a watch
// still open, a failed write.
const sampleLog = `{"auditID":"a","stage":"ResponseStarted","requestURI":"/api/v1/namespaces/n/persistentvolumeclaims/c","verb":"update","user":{"username":"admin"},"userAgent":"csi-sidecars/provisioner","objectRef":{"resource":"persistentvolumeclaims","namespace":"n","name":"c"},"requestReceivedTimestamp":"2026-01-02T03:04:05.000000Z","stageTimestamp":"2026-01-02T03:04:05.100000Z"}
{"auditID":"b","stage":"ResponseStarted","requestURI":"/api/v1/persistentvolumes?sendInitialEvents=true\u0026watch=true","verb":"watch","user":{"username":"admin"},"userAgent":"csi-provisioner/v6.3.0","objectRef":{"resource":"persistentvolumes"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2026-01-02T03:04:05.000000Z","stageTimestamp":"2026-01-02T03:04:05.000000Z"}
{"auditID":"a","stage":"ResponseComplete","requestURI":"/api/v1/namespaces/n/persistentvolumeclaims/c","verb":"update","user":{"username":"admin"},"userAgent":"csi-sidecars/provisioner","objectRef":{"resource":"persistentvolumeclaims","namespace":"n","name":"c"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2026-01-02T03:04:05.000000Z","stageTimestamp":"2026-01-02T03:04:05.200000Z"}
{"auditID":"c","stage":"ResponseComplete","requestURI":"/apis/storage.k8s.io/v1/volumeattachments/va/status","verb":"patch","user":{"username":"admin"},"userAgent":"csi-attacher/v4.12.0","objectRef":{"resource":"volumeattachments","subresource":"status","name":"va"},"responseStatus":{"code":409},"requestReceivedTimestamp":"2026-01-02T03:04:06.000000Z","stageTimestamp":"2026-01-02T03:04:06.000000Z"}
`

func TestReadKeepsOneEventPerRequestAtItsLastStage(t *testing.T) {
	events := readLog(t, sampleLog)
	if len(events) != 3 {
		t.Fatalf("%d events, want 3: %+v", len(events), events)
	}
	update, watch, patch := events[0], events[1], events[2]
	if update.Stage != "ResponseComplete" || update.Code() != 200 || !update.IsWrite() || update.Failed() || update.IsList() ||
		update.Resource() != "persistentvolumeclaims" || update.Namespace() != "n" || update.Name() != "c" || update.UserAgent != "csi-sidecars/provisioner" {
		t.Errorf("update: %+v", update)
	}
	if watch.IsWrite() || !watch.IsList() || watch.Name() != "" {
		t.Errorf("watch with initial events: write %v, list %v", watch.IsWrite(), watch.IsList())
	}
	if !patch.IsWrite() || !patch.Failed() || patch.Code() != 409 || patch.Resource() != "volumeattachments/status" {
		t.Errorf("failed patch: %+v, resource %s", patch, patch.Resource())
	}
}

func TestReadRejectsALineThatIsNoEvent(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	if err := os.WriteFile(path, []byte(sampleLog+"not json\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Read(path); err == nil || !strings.Contains(err.Error(), "not json") {
		t.Errorf("Read of a broken log: %v, want an error quoting the line", err)
	}
}

func TestSetupWritesThePolicyAndNamesTheLog(t *testing.T) {
	dir := t.TempDir()
	args, log, err := Setup(dir, "policy")
	if err != nil {
		t.Fatal(err)
	}
	if log != filepath.Join(dir, "audit.log") {
		t.Errorf("log %s", log)
	}
	joined := strings.Join(args, " ")
	for _, want := range []string{"--audit-log-path=" + log, "--audit-log-format=json", "--audit-policy-file=" + filepath.Join(dir, "audit-policy.yaml")} {
		if !strings.Contains(joined, want) {
			t.Errorf("args %q lack %s", joined, want)
		}
	}
	if raw, err := os.ReadFile(filepath.Join(dir, "audit-policy.yaml")); err != nil || string(raw) != "policy" {
		t.Errorf("policy file: %q, %v", raw, err)
	}
}

// A tally's writes by kind and failed ones, GETs apart; an event's count patch, which names
// no object, is about the object its creation named.
func TestTallyAndEventBodies(t *testing.T) {
	const log = `{"auditID":"1","verb":"create","userAgent":"u","objectRef":{"resource":"events","namespace":"n","name":"e.1"},"responseStatus":{"code":201},"requestObject":{"involvedObject":{"kind":"VolumeSnapshotContent","name":"c"},"source":{"component":"csi-snapshotter d"}}}
{"auditID":"2","verb":"patch","userAgent":"u","objectRef":{"resource":"events","namespace":"n","name":"e.1"},"responseStatus":{"code":200},"requestObject":{"count":2}}
{"auditID":"3","verb":"patch","userAgent":"u","objectRef":{"resource":"volumesnapshotcontents","subresource":"status","name":"c"},"responseStatus":{"code":409}}
{"auditID":"4","verb":"get","userAgent":"u","objectRef":{"resource":"volumesnapshotcontents","name":"c"},"responseStatus":{"code":200}}
`
	events := readLog(t, log)
	bodies := EventBodies{}
	for _, e := range events[:2] {
		b := bodies.Of(e)
		if b == nil || b.Object() != (ObjectRef{Kind: "VolumeSnapshotContent", Name: "c"}) || b.Component() != "csi-snapshotter d" {
			t.Errorf("event %s: body %+v", e.AuditID, b)
		}
	}
	tally := NewTally()
	for _, e := range events {
		tally.Add(e)
	}
	tally.Ops = 2
	if tally.Writes != 3 || tally.Gets != 1 || tally.PerOpString() != "1.50" || tally.FailedString() != "0.50/0/0" ||
		tally.Kinds() != "create events 0.50, patch events 0.50, patch volumesnapshotcontents/status 0.50" {
		t.Errorf("tally: %+v, %s per op, failed %s, kinds %s", tally, tally.PerOpString(), tally.FailedString(), tally.Kinds())
	}
}

// readLog reads the audit log text through a file, as Read does.
func readLog(t *testing.T, text string) []Event {
	t.Helper()
	path := filepath.Join(t.TempDir(), "audit.log")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	events, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	return events
}
