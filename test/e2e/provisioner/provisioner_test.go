package provisioner

import (
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/types"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// 50 claims over an Immediate class (reclaim Delete, templated secrets) and a
// WaitForFirstConsumer class (reclaim Retain) get their volumes and PersistentVolumes; a
// claim whose secret is missing waits for it; released volumes are deleted or kept as
// their reclaim policy says.
func TestProvisionsFiftyClaimsAcrossTwoClassesAndReclaimsThemByPolicy(t *testing.T) {
	s := newScenario(t, testdriver.Config{Topology: true, Latency: 20 * time.Millisecond})
	nodes := []string{s.createNode("n1"), s.createNode("n2")}
	immediate := s.createClass("immediate", func(sc *storagev1.StorageClass) {
		sc.Parameters["csi.storage.k8s.io/provisioner-secret-name"] = "${pvc.name}-creds"
		sc.Parameters["csi.storage.k8s.io/provisioner-secret-namespace"] = "${pvc.namespace}"
		sc.Parameters["csi.storage.k8s.io/node-stage-secret-name"] = "stage-${pvc.annotations['example.com/owner']}"
		sc.Parameters["csi.storage.k8s.io/node-stage-secret-namespace"] = "${pvc.namespace}"
		sc.Parameters["csi.storage.k8s.io/fstype"] = "xfs"
	})
	late := s.createClass("late", func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
		sc.ReclaimPolicy = ptr.To(v1.PersistentVolumeReclaimRetain)
	})
	a := s.startReplica("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)

	claims := map[types.UID]*v1.PersistentVolumeClaim{}
	selected := map[types.UID]string{}
	for i := range 25 {
		name := fmt.Sprintf("fast-%02d", i)
		if i > 0 { // fast-00's secret comes later
			s.createSecret(name + "-creds")
		}
		c := s.createClaimAnnotated(name, immediate.Name, "", map[string]string{"example.com/owner": "team"})
		claims[c.UID] = c
	}
	for i := range 25 {
		node := nodes[i%2]
		c := s.createClaim(fmt.Sprintf("late-%02d", i), late.Name, node)
		claims[c.UID], selected[c.UID] = c, node
	}

	s.waitForPVs(49)
	s.WaitUntil("fast-00 reported as waiting for its secret", func() bool {
		return slices.ContainsFunc(s.events("fast-00", "ProvisioningFailed"), func(m string) bool { return strings.Contains(m, "fast-00-creds") })
	})
	for _, c := range createCalls(s.Driver.Journal()) {
		if c.VolumeName == "pvc-"+string(findClaim(claims, "fast-00").UID) {
			t.Errorf("CreateVolume was called for fast-00 without its secret")
		}
	}
	s.createSecret("fast-00-creds")
	s.waitForPVs(50)

	byClaim := s.pvsByClaim()
	for uid, c := range claims {
		pvs := byClaim[uid]
		if len(pvs) != 1 {
			t.Errorf("claim %s has %d PersistentVolumes, want 1", c.Name, len(pvs))
			continue
		}
		pv := pvs[0]
		if pv.Name != "pvc-"+string(uid) || pv.Spec.ClaimRef.Name != c.Name || pv.Spec.ClaimRef.Namespace != s.Namespace ||
			pv.Annotations[volumehelpers.AnnDynamicallyProvisioned] != s.driver {
			t.Errorf("PersistentVolume %s does not record claim %s: claimRef %+v", pv.Name, c.Name, pv.Spec.ClaimRef)
		}
		if node := selected[uid]; node != "" {
			terms := pv.Spec.NodeAffinity.Required.NodeSelectorTerms
			if pv.Spec.PersistentVolumeReclaimPolicy != v1.PersistentVolumeReclaimRetain || len(terms) != 1 || terms[0].MatchExpressions[0].Values[0] != node {
				t.Errorf("late PersistentVolume %s: policy %s, affinity %+v; want Retain on %s", pv.Name, pv.Spec.PersistentVolumeReclaimPolicy, terms, node)
			}
			continue
		}
		if pv.Spec.PersistentVolumeReclaimPolicy != v1.PersistentVolumeReclaimDelete || pv.Spec.CSI.FSType != "xfs" ||
			pv.Annotations["volume.kubernetes.io/provisioner-deletion-secret-name"] != c.Name+"-creds" ||
			pv.Spec.CSI.NodeStageSecretRef == nil || pv.Spec.CSI.NodeStageSecretRef.Name != "stage-team" ||
			!slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer) {
			t.Errorf("fast PersistentVolume %s: policy %s, fsType %q, annotations %v, node-stage secret %+v, finalizers %v",
				pv.Name, pv.Spec.PersistentVolumeReclaimPolicy, pv.Spec.CSI.FSType, pv.Annotations, pv.Spec.CSI.NodeStageSecretRef, pv.Finalizers)
		}
	}
	if n := len(s.Driver.Volumes()); n != 50 {
		t.Errorf("%d volumes in the driver, want 50", n)
	}

	// The claims are gone (as far as the PV controller is concerned): release every volume.
	for _, pv := range s.pvs() {
		s.markReleased(pv)
	}
	s.WaitUntil("the 25 Delete volumes deleted and their PersistentVolumes let go", func() bool {
		deleted := 0
		for _, pv := range s.pvs() {
			if pv.DeletionTimestamp != nil && !slices.Contains(pv.Finalizers, volumehelpers.PVDeletionProtectionFinalizer) {
				deleted++
			}
		}
		return deleted == 25 && len(s.Driver.Volumes()) == 25
	})
	for _, pv := range s.pvs() {
		retain := pv.Spec.PersistentVolumeReclaimPolicy == v1.PersistentVolumeReclaimRetain
		if _, inDriver := s.Driver.Volume(pv.Spec.CSI.VolumeHandle); inDriver != retain {
			t.Errorf("PersistentVolume %s (%s): volume in driver %v", pv.Name, pv.Spec.PersistentVolumeReclaimPolicy, inDriver)
		}
		if retain && pv.DeletionTimestamp != nil {
			t.Errorf("Retain PersistentVolume %s was deleted", pv.Name)
		}
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("%d overlapping operations: %+v", len(o), o)
	}
	_, metrics := a.Get("/metrics")
	for _, m := range []string{"controller_persistentvolumeclaim_provision_total", "controller_persistentvolume_delete_total"} {
		if !strings.Contains(metrics, m) {
			t.Errorf("metric %s not served", m)
		}
	}
}

// P1, P2, P7: SIGTERM while CreateVolume calls are slow: the calls in flight finish and
// are recorded as PersistentVolumes, the leader exits 0, and the standby carries on with
// the rest at once. Every volume ends as exactly one PersistentVolume, none is left in the
// driver without one, and no two operations on a volume overlap.
func TestSIGTERMDuringSlowCreateVolumeRecordsEveryVolumeOnceAndTheStandbyContinues(t *testing.T) {
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: slow}})
	sc := s.createClass("fast", nil)
	a := s.startReplica("replica-a", "--worker-threads=4")
	s.WaitForHolder(s.leaseName, "replica-a")
	b := s.startReplica("replica-b", "--worker-threads=4")
	a.WaitReady(t)
	b.WaitReady(t)
	for i := range 12 {
		s.createClaim(fmt.Sprintf("data-%02d", i), sc.Name, "")
	}
	s.WaitForCalls("4 CreateVolume calls in flight on replica-a", func(c []testdriver.Call) bool {
		return e2e.Running(e2e.CallsOn(c, a, testdriver.MethodCreateVolume)) == 4
	})

	signalled := a.Signal(t, syscall.SIGTERM)
	if code := a.Wait(t, 30*time.Second); code != 0 {
		t.Errorf("leader exit code %d, want 0", code)
	}
	s.WaitForCalls("replica-b's first CreateVolume", func(c []testdriver.Call) bool {
		return len(e2e.CallsOn(c, b, testdriver.MethodCreateVolume)) > 0
	})
	gap := e2e.CallsOn(s.Driver.Journal(), b, testdriver.MethodCreateVolume)[0].Start.Sub(a.ExitedAt)
	t.Logf("FIGURE provisioner takeover: standby's first CreateVolume %v after the leader exited (drain %v; retry period 10s)",
		gap.Round(time.Millisecond), a.ExitedAt.Sub(signalled).Round(time.Millisecond))
	if gap > 5*time.Second {
		t.Errorf("standby's first CreateVolume came %v after the leader exited, want well below the 10s retry period", gap)
	}
	s.waitForPVs(12)

	for _, c := range e2e.CallsOn(s.Driver.Journal(), a, testdriver.MethodCreateVolume) {
		if c.Start.After(signalled) {
			t.Errorf("replica-a started CreateVolume %s %v after the signal", c.VolumeName, c.Start.Sub(signalled))
		}
		if c.Canceled || !c.CallerGone.IsZero() || c.Code != "OK" {
			t.Errorf("replica-a's CreateVolume %s: code %s, cancelled %v; want OK, waited for", c.VolumeName, c.Code, c.Canceled)
		}
	}
	s.checkEveryVolumeHasExactlyOnePV()
	if n := len(s.Driver.Volumes()); n != 12 {
		t.Errorf("%d volumes in the driver, want 12", n)
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("%d overlapping operations: %+v", len(o), o)
	}
}

// SIGKILL leaves CreateVolume calls running in the driver with nothing recorded; the
// standby takes the expired Lease and calls CreateVolume again with the same names, so the
// driver hands back the same volumes: no duplicates, every volume recorded once.
func TestSIGKILLedLeaderLeavesNoDuplicateVolumes(t *testing.T) {
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: slow}})
	sc := s.createClass("fast", nil)
	short := []string{"--worker-threads=4", "--leader-election-lease-duration=3s", "--leader-election-renew-deadline=2s", "--leader-election-retry-period=500ms"}
	a := s.startReplica("replica-a", short...)
	s.WaitForHolder(s.leaseName, "replica-a")
	b := s.startReplica("replica-b", short...)
	a.WaitReady(t)
	b.WaitReady(t)
	for i := range 8 {
		s.createClaim(fmt.Sprintf("data-%02d", i), sc.Name, "")
	}
	s.WaitForCalls("4 CreateVolume calls in flight on replica-a", func(c []testdriver.Call) bool {
		return e2e.Running(e2e.CallsOn(c, a, testdriver.MethodCreateVolume)) == 4
	})
	inFlight := map[string]bool{}
	for _, c := range e2e.CallsOn(s.Driver.Journal(), a, testdriver.MethodCreateVolume) {
		inFlight[c.VolumeName] = true
	}
	a.Signal(t, syscall.SIGKILL)
	a.Wait(t, 10*time.Second)
	s.WaitForHolder(s.leaseName, "replica-b")
	s.waitForPVs(8)

	retried := 0
	for _, c := range e2e.CallsOn(s.Driver.Journal(), b, testdriver.MethodCreateVolume) {
		if inFlight[c.VolumeName] {
			retried++
		}
	}
	t.Logf("FIGURE SIGKILL: %d CreateVolume calls were in flight; replica-b called CreateVolume again for %d of them", len(inFlight), retried)
	names := map[string]int{}
	for _, v := range s.Driver.Volumes() {
		names[v.Name]++
	}
	for name, n := range names {
		if n != 1 {
			t.Errorf("%d volumes named %s", n, name)
		}
	}
	if len(names) != 8 {
		t.Errorf("%d volumes in the driver, want 8", len(names))
	}
	s.checkEveryVolumeHasExactlyOnePV()
}

func findClaim(claims map[types.UID]*v1.PersistentVolumeClaim, name string) *v1.PersistentVolumeClaim {
	for _, c := range claims {
		if c.Name == name {
			return c
		}
	}
	return nil
}
