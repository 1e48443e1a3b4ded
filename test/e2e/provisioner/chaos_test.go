package provisioner

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The provisioner's record (package doc, "No leaked volumes"), under chaos:
// every round SIGKILLs the leader while its CreateVolume calls run, and while nobody leads
// deletes a third of the round's claims and reschedules another part, as users and the
// scheduler would. What upstream leaks there (its issue 486) must not leak here.

// Names of the record, as the provisioner package spells them: events labelled with the
// claim's UID; one carrying the record opens it, one listing it under "closes" closes it.
const (
	recordLabel      = "provisioner.csi-sidecars.io/record"
	recordClaimLabel = "provisioner.csi-sidecars.io/claim-uid"
	recordAnnotation = "provisioner.csi-sidecars.io/provisioning"
	recordCloses     = "provisioner.csi-sidecars.io/closes"
	// pvcProtectionFinalizer is what the API server's admission puts on every claim and
	// kube-controller-manager removes once no pod uses it.
	pvcProtectionFinalizer = "kubernetes.io/pvc-protection"
)

// chaosClaims per round: half on an Immediate class, half on a WaitForFirstConsumer one
// (selected node n1). Claim i is deleted when i%3 == 0 and, if delayed, rescheduled to n2
// when i%3 == 1: a third deleted, a sixth rescheduled, the rest left alone.
const chaosClaims = 6

// chaosResult is what a chaos run observed.
type chaosResult struct {
	rounds, claims, deleted, rescheduled int
	// atRisk counts volumes the killed leaders' CreateVolume calls made for claims then
	// deleted during the failover: the volumes upstream leaks (nobody records them).
	atRisk int
	// leaked: backend volumes without a PersistentVolume; orphanPVs: PersistentVolumes of
	// the driver without a backend volume; stuck: deleted claims still there, live claims
	// without their volume or still carrying the record. All at the end of the run.
	leaked, orphanPVs, stuck int
	overlaps                 int
	// converge is, per round, from the SIGKILL to every claim settled.
	converge []time.Duration
}

// chaosClaim is one claim of a run and what happened to it.
type chaosClaim struct {
	name        string
	uid         types.UID
	late        bool
	deleted     bool
	rescheduled bool
}

// node the claim's volume must be on ("" for the Immediate class, any).
func (c *chaosClaim) node(s *scenario) string {
	switch {
	case !c.late:
		return ""
	case c.rescheduled:
		return s.name("n2")
	}
	return s.name("n1")
}

type chaos struct {
	*scenario
	kubeconfig string
	fast, late string
	claims     []*chaosClaim
	// batch and names are the round's claims and their volumes' names.
	batch []*chaosClaim
	names map[string]bool
	res   chaosResult
}

// runChaos runs rounds rounds of e2e.ChaosRounds and returns its figures; t fails on
// anything but a clean end (no leak, no orphan, nothing stuck, no overlap).
func runChaos(t testing.TB, rounds int) chaosResult {
	s := newScenario(t, testdriver.Config{Topology: true, MethodLatency: map[string]time.Duration{testdriver.MethodCreateVolume: slow}})
	c := &chaos{scenario: s}
	s.createNode("n1")
	s.createNode("n2")
	c.fast = s.createClass("fast", nil).Name
	c.late = s.createClass("late", func(sc *storagev1.StorageClass) {
		sc.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	}).Name
	// Exactly upstream's RBAC: the record is written with the verbs upstream grants.
	c.kubeconfig = s.upstreamServiceAccount(snapshotVerbsV62)
	run := &e2e.ChaosRounds{S: s.Scenario, Lease: s.leaseName,
		Start: func(name, id string) *e2e.Replica {
			return s.startReplica(name, append([]string{"--kubeconfig=" + c.kubeconfig, "--leader-election-identity=" + id}, e2e.ChaosLease...)...)
		},
		Work: c.createClaims, InFlight: c.provisioning, Leaderless: c.deleteAndMove,
		Problems: func() []string { return c.problems(true) }, Settled: c.countAtRisk,
	}
	run.Run(rounds)
	c.res.rounds, c.res.converge = run.Rounds, run.Converge
	c.settleFigures()
	all := make([]*e2e.Replica, 0, len(run.Replicas))
	for _, r := range run.Replicas {
		all = append(all, r)
	}
	e2e.NoForbidden(t, all...)
	return c.res
}

// createClaims creates the round's claims.
func (c *chaos) createClaims(round int) {
	c.batch, c.names = nil, map[string]bool{}
	for i := range chaosClaims {
		cc := &chaosClaim{name: fmt.Sprintf("r%02d-%d", round, i), late: i%2 == 1}
		class, node := c.fast, ""
		if cc.late {
			class, node = c.late, c.name("n1")
		}
		cc.uid = c.createClaim(cc.name, class, node).UID
		c.names[volumeNameOf(cc.uid)] = true
		c.batch = append(c.batch, cc)
	}
	c.claims = append(c.claims, c.batch...)
}

// provisioning tells whether every CreateVolume of the round runs on r.
func (c *chaos) provisioning(_ int, calls []testdriver.Call, r *e2e.Replica) bool {
	return e2e.Running(e2e.CallsFor(calls, r, testdriver.MethodCreateVolume, volumeName, c.names)) == chaosClaims
}

func volumeName(c testdriver.Call) string { return c.VolumeName }

// deleteAndMove is what happens while nobody leads (the Lease runs out in 3 s): users
// delete claims, the scheduler moves some.
func (c *chaos) deleteAndMove(int) {
	for i, cc := range c.batch {
		switch {
		case i%3 == 0:
			c.deleteClaim(cc.name)
			cc.deleted = true
		case i%3 == 1 && cc.late:
			c.selectNode(cc.name, c.name("n2"))
			cc.rescheduled = true
		}
	}
}

// countAtRisk counts what upstream would have leaked: volumes the dead leader's calls made
// (they ran to their end in the driver) for claims deleted before anyone recorded them.
func (c *chaos) countAtRisk(_ int, leader *e2e.Replica) {
	deleted := map[string]bool{}
	for _, cc := range c.batch {
		deleted[volumeNameOf(cc.uid)] = cc.deleted
	}
	c.res.atRisk += e2e.Succeeded(e2e.CallsFor(c.Driver.Journal(), leader, testdriver.MethodCreateVolume, volumeName, deleted))
}

// volumeNameOf is the provisioner's volume name of a claim (default flags).
func volumeNameOf(uid types.UID) string { return "pvc-" + string(uid) }

// deleteClaim deletes a claim as a user does, after doing what kube-controller-manager's
// PVC protection controller does for a claim no pod uses (none runs here): its
// kubernetes.io/pvc-protection finalizer goes, and the claim with it.
func (c *chaos) deleteClaim(name string) {
	c.T.Helper()
	claims := c.Client.CoreV1().PersistentVolumeClaims(c.Namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		claim, err := claims.Get(c.ctx(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if !slices.Contains(claim.Finalizers, pvcProtectionFinalizer) {
			return nil
		}
		claim.Finalizers = slices.DeleteFunc(claim.Finalizers, func(f string) bool { return f == pvcProtectionFinalizer })
		_, err = claims.Update(c.ctx(), claim, metav1.UpdateOptions{})
		return err
	})
	if err == nil {
		err = claims.Delete(c.ctx(), name, metav1.DeleteOptions{})
	}
	if err != nil {
		c.T.Fatalf("deleting claim %s: %v", name, err)
	}
}

// selectNode moves a claim to another node, as the scheduler does when it picks again.
func (c *chaos) selectNode(name, node string) {
	c.T.Helper()
	claims := c.Client.CoreV1().PersistentVolumeClaims(c.Namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		claim, err := claims.Get(c.ctx(), name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		claim.Annotations[volumehelpers.AnnSelectedNode] = node
		_, err = claims.Update(c.ctx(), claim, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		c.T.Fatalf("selecting node %s for claim %s: %v", node, name, err)
	}
}

// problems lists what is not settled: a deleted claim still there, a live claim without
// its PersistentVolume (on the node it selects now) or still carrying the record, a
// PersistentVolume without its volume or of a claim that is gone, a volume without a
// PersistentVolume. With release it also plays kube-controller-manager's PV controller,
// which is not running: a PersistentVolume whose claim is gone is marked Released, for the
// provisioner to delete.
func (c *chaos) problems(release bool) []string {
	c.T.Helper()
	list, err := c.Client.CoreV1().PersistentVolumeClaims(c.Namespace).List(c.ctx(), metav1.ListOptions{})
	if err != nil {
		return []string{err.Error()}
	}
	live := map[types.UID]*v1.PersistentVolumeClaim{}
	for i := range list.Items {
		live[list.Items[i].UID] = &list.Items[i]
	}
	pvs := c.pvs()
	open, err := c.openRecords()
	if err != nil {
		return []string{err.Error()}
	}
	var out []string
	for _, cc := range c.claims {
		if open[cc.uid] {
			out = append(out, fmt.Sprintf("claim %s's record is still open", cc.name))
		}
		claim := live[cc.uid]
		if cc.deleted {
			if claim != nil {
				out = append(out, fmt.Sprintf("deleted claim %s is still there (finalizers %v)", cc.name, claim.Finalizers))
			}
			continue
		}
		if claim == nil {
			out = append(out, fmt.Sprintf("claim %s is gone", cc.name))
			continue
		}
		pv := pvs[volumeNameOf(cc.uid)]
		switch {
		case pv == nil || pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.UID != cc.uid:
			out = append(out, fmt.Sprintf("claim %s has no PersistentVolume", cc.name))
		case cc.node(c.scenario) != "" && pvNode(pv) != cc.node(c.scenario):
			out = append(out, fmt.Sprintf("claim %s's PersistentVolume is on %q, want %s", cc.name, pvNode(pv), cc.node(c.scenario)))
		}
	}
	handles := map[string]bool{}
	for _, pv := range pvs {
		handles[pv.Spec.CSI.VolumeHandle] = true
		if _, ok := c.Driver.Volume(pv.Spec.CSI.VolumeHandle); !ok && pv.DeletionTimestamp == nil {
			out = append(out, fmt.Sprintf("PersistentVolume %s has no volume %s", pv.Name, pv.Spec.CSI.VolumeHandle))
		}
		if pv.Spec.ClaimRef == nil || live[pv.Spec.ClaimRef.UID] == nil {
			out = append(out, fmt.Sprintf("PersistentVolume %s is of a claim that is gone", pv.Name))
			if release {
				c.release(pv.Name)
			}
		}
	}
	for _, v := range c.Driver.Volumes() {
		if !handles[v.ID] {
			out = append(out, fmt.Sprintf("volume %s (%s) has no PersistentVolume", v.ID, v.Name))
		}
	}
	return out
}

// openRecords are the UIDs of the claims whose record is open, as the events say.
func (c *chaos) openRecords() (map[types.UID]bool, error) {
	events, err := c.Client.CoreV1().Events(c.Namespace).List(c.ctx(), metav1.ListOptions{LabelSelector: recordLabel})
	if err != nil {
		return nil, err
	}
	closed := map[string]bool{}
	for _, ev := range events.Items {
		for _, name := range strings.Split(ev.Annotations[recordCloses], ",") {
			closed[name] = true
		}
	}
	open := map[types.UID]bool{}
	for _, ev := range events.Items {
		if _, opens := ev.Annotations[recordAnnotation]; opens && !closed[ev.Name] {
			open[types.UID(ev.Labels[recordClaimLabel])] = true
		}
	}
	return open, nil
}

// release marks a PersistentVolume Released, as the PV controller does once its claim is
// gone.
func (c *chaos) release(name string) {
	pvs := c.Client.CoreV1().PersistentVolumes()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pv, err := pvs.Get(c.ctx(), name, metav1.GetOptions{})
		if err != nil || pv.Status.Phase == v1.VolumeReleased {
			return err
		}
		pv.Status.Phase = v1.VolumeReleased
		_, err = pvs.UpdateStatus(c.ctx(), pv, metav1.UpdateOptions{})
		return err
	})
	if err != nil && !apierrors.IsNotFound(err) {
		c.T.Errorf("releasing PersistentVolume %s: %v", name, err)
	}
}

// pvNode is the node a PersistentVolume's affinity names ("" for none).
func pvNode(pv *v1.PersistentVolume) string {
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return ""
	}
	for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, e := range term.MatchExpressions {
			if e.Key == testdriver.TopologyKey && len(e.Values) == 1 {
				return e.Values[0]
			}
		}
	}
	return ""
}

// settleFigures counts, at the end of the run, what is left over.
func (c *chaos) settleFigures() {
	pvs := c.pvs()
	handles := map[string]bool{}
	for _, pv := range pvs {
		handles[pv.Spec.CSI.VolumeHandle] = true
		if _, ok := c.Driver.Volume(pv.Spec.CSI.VolumeHandle); !ok {
			c.res.orphanPVs++
		}
	}
	for _, v := range c.Driver.Volumes() {
		if !handles[v.ID] {
			c.res.leaked++
		}
	}
	for _, p := range c.problems(false) {
		if strings.HasPrefix(p, "deleted claim") || strings.HasPrefix(p, "claim ") {
			c.res.stuck++
		}
	}
	for _, cc := range c.claims {
		c.res.claims++
		if cc.deleted {
			c.res.deleted++
		}
		if cc.rescheduled {
			c.res.rescheduled++
		}
	}
	c.res.overlaps = len(c.Driver.Overlaps())
}

// check fails t unless the run ended clean, and logs its figures.
func (r chaosResult) check(t testing.TB) {
	t.Helper()
	mean, longest := e2e.MeanAndLongest(r.converge)
	t.Logf("FIGURE provisioner chaos: %d rounds, %d claims (%d deleted and %d rescheduled while nobody led); %d volumes upstream would have leaked",
		r.rounds, r.claims, r.deleted, r.rescheduled, r.atRisk)
	t.Logf("FIGURE provisioner chaos: leaked %d volumes, %d PersistentVolumes without a volume, %d claims stuck, %d overlaps; converged %.1fs after the kill on average, %.1fs at most",
		r.leaked, r.orphanPVs, r.stuck, r.overlaps, mean, longest)
	if r.leaked != 0 || r.orphanPVs != 0 || r.stuck != 0 || r.overlaps != 0 {
		t.Errorf("leaked %d volumes, %d PersistentVolumes without a volume, %d claims stuck, %d overlaps: want 0 of each", r.leaked, r.orphanPVs, r.stuck, r.overlaps)
	}
}

// The short chaos run of `make test`: a few rounds of SIGKILL while CreateVolume runs, with
// claims deleted and rescheduled during each failover; nothing leaks, nothing is stuck,
// nothing overlaps in the driver.
func TestChaosSIGKILLWhileProvisioningLeaksNothing(t *testing.T) {
	runChaos(t, 3).check(t)
}

// BenchmarkProvisionerChaos is the full chaos run, 20 rounds: volumes leaked (and those
// upstream would have leaked), PersistentVolumes without a volume, claims stuck, overlaps,
// and the time from each SIGKILL until every claim is settled.
func BenchmarkProvisionerChaos(b *testing.B) {
	for range b.N {
		r := runChaos(b, 20)
		r.check(b)
		mean, longest := e2e.MeanAndLongest(r.converge)
		b.ReportMetric(float64(r.leaked), "leaked-volumes")
		b.ReportMetric(float64(r.atRisk), "upstream-would-leak")
		b.ReportMetric(float64(r.orphanPVs), "pvs-without-volume")
		b.ReportMetric(float64(r.stuck), "stuck-claims")
		b.ReportMetric(float64(r.overlaps), "overlaps")
		b.ReportMetric(mean, "converge-s")
		b.ReportMetric(longest, "converge-max-s")
	}
}
