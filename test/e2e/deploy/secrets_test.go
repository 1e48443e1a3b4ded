package deploy

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
)

// secretKinds are the Secrets a StorageClass or VolumeSnapshotClass can name, by the
// prefix of their parameters.
var secretKinds = []string{"provisioner", "controller-publish", "controller-expand", "controller-modify", "node-stage", "node-publish", "snapshotter"}

// No secret in any log at any verbosity: every sidecar at -v=10 (where client-go logs
// every response body whole), as four processes and as one combined process, provisions,
// attaches, expands and snapshots with a Secret named by every class parameter that
// carries one. No Secret's value appears in any log, Event or object, in clear, base64 or
// hex form, while the logs do hold other response bodies (so they are at -v=10).
func TestNoSecretValueReachesAnyLogAtVerbosity10(t *testing.T) {
	for _, combined := range []bool{false, true} {
		name := "four processes"
		if combined {
			name = "one combined process"
		}
		t.Run(name, func(t *testing.T) { checkNoSecretInLogs(t, combined) })
	}
}

func checkNoSecretInLogs(t *testing.T, combined bool) {
	cp := kube.Get(t)
	s := e2e.NewScenario(t, cp, binDir, controllerDriver())
	snaps := installSnapshotCRDs(t, s)
	ctx := context.Background()
	values := map[string]string{}
	classParams := map[string]string{}
	snapParams := map[string]string{}
	for _, kind := range secretKinds {
		// Letters that are no hex digit, so that no UID or hex dump of other data can
		// match a part of the value by chance.
		b := make([]byte, 30)
		if _, err := rand.Read(b); err != nil {
			t.Fatal(err)
		}
		for i := range b {
			b[i] = "GHJKMNPQRSTVWXYZ"[b[i]%16]
		}
		value := string(b) + "-" + kind
		values[kind] = value
		secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: kind, Namespace: s.Namespace}, Data: map[string][]byte{"password": []byte(value)}}
		if _, err := s.Client.CoreV1().Secrets(s.Namespace).Create(ctx, secret, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		params := classParams
		if kind == "snapshotter" {
			params = snapParams
		}
		params["csi.storage.k8s.io/"+kind+"-secret-name"] = kind
		params["csi.storage.k8s.io/"+kind+"-secret-namespace"] = s.Namespace
	}
	store := s.SetUpStorage(classParams)
	var replicas []*e2e.Replica
	if combined {
		replicas = append(replicas, s.Start("combined", []string{"csi-sidecars", allFour}, "-v=10"))
	} else {
		for _, sidecar := range sidecars {
			replicas = append(replicas, s.Start(sidecar, []string{"csi-sidecars", sidecar}, "-v=10"))
		}
	}
	for _, r := range replicas {
		r.WaitReady(t)
	}
	runStorageJob(ctx, t, s, store, "claim-a")
	runSnapshotJob(ctx, t, s, snaps, store, snapParams)

	// Everything a user or a log pipeline keeps: the logs, the Events, the objects.
	places := map[string]string{}
	for _, r := range replicas {
		log, err := os.ReadFile(filepath.Join(s.Dir, r.Name+".log"))
		if err != nil {
			t.Fatal(err)
		}
		places["log of "+r.Name] = string(log)
		if !strings.Contains(string(log), "Response Body") {
			t.Errorf("the log of %s holds no response body: it is not at -v=10, and the test proves nothing", r.Name)
		}
	}
	dump := func(what string, obj any, err error) {
		if err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(obj)
		places[what] = string(b)
	}
	events, err := s.Client.CoreV1().Events(s.Namespace).List(ctx, metav1.ListOptions{})
	dump("Events", events, err)
	pvs, err := s.Client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	dump("PersistentVolumes", pvs, err)
	pvcs, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).List(ctx, metav1.ListOptions{})
	dump("PersistentVolumeClaims", pvcs, err)
	vas, err := s.Client.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	dump("VolumeAttachments", vas, err)
	contents, err := snaps.SnapshotV1().VolumeSnapshotContents().List(ctx, metav1.ListOptions{})
	dump("VolumeSnapshotContents", contents, err)

	hits := 0
	for kind, value := range values {
		forms := secretForms(value)
		for where, text := range places {
			n := 0
			for _, line := range strings.Split(text, "\n") {
				if slices.ContainsFunc(forms, func(f string) bool { return strings.Contains(line, f) }) {
					n++
				}
			}
			if n > 0 {
				hits += n
				t.Errorf("the %s secret's value is in the %s (%d lines)", kind, where, n)
			}
		}
	}
	t.Logf("FIGURE secret values in logs, Events and objects at -v=10: %d", hits)
}

// secretForms are the ways value can show in a log: whole in clear, base64 or hex, and cut
// up by client-go's hex dumps, which show 16 bytes a line, the hex in two runs of 8 and the
// characters in a right column. The random part is 30 characters, so one line of a dump
// holds 15 of them at least: any 12 characters of it, or the hex of any 7 bytes, give it
// away; shorter windows would match other data by chance.
func secretForms(value string) []string {
	forms := []string{value, base64.StdEncoding.EncodeToString([]byte(value)), hex.EncodeToString([]byte(value))}
	random := value[:strings.Index(value, "-")]
	for i := 0; i+12 <= len(random); i++ {
		forms = append(forms, random[i:i+12])
	}
	for i := 0; i+7 <= len(random); i++ {
		forms = append(forms, spacedHex([]byte(random[i:i+7])))
	}
	return forms
}

// spacedHex is b as a hex dump shows it: two digits a byte, a space between.
func spacedHex(b []byte) string {
	parts := make([]string, len(b))
	for i, c := range b {
		parts[i] = fmt.Sprintf("%02x", c)
	}
	return strings.Join(parts, " ")
}
