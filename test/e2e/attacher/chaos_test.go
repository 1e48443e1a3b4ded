package attacher

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The attacher's counterpart of the provisioner's chaos run: every round SIGKILLs the
// leader while its ControllerPublishVolume calls run, and while nobody leads deletes a
// third of the round's VolumeAttachments, as the attach/detach controller does when the
// pod goes. The finalizer the attacher puts on a VolumeAttachment before publishing keeps
// it until whoever leads next has unpublished: no deleted attachment leaves a publication
// in the driver.

const (
	// attachChaosVolumes per round; attachment i is deleted during the failover when
	// i%3 == 0.
	attachChaosVolumes = 6
	attachChaosLatency = 2 * time.Second
)

// attachChaosResult is what an attacher chaos run observed.
type attachChaosResult struct {
	rounds, attachments, deleted int
	// uncertain counts deleted attachments whose publish the killed leader had started:
	// the driver finished it after the leader died, so only the detach undoes it.
	uncertain int
	// left: publications in the driver of deleted attachments; stuck: deleted attachments
	// still there, or live ones not attached and published. At the end of the run.
	left, stuck, overlaps int
	converge              []time.Duration
}

type attachChaosItem struct {
	va, volumeID string
	deleted      bool
}

type attachChaos struct {
	*scenario
	items []*attachChaosItem
	// batch and ids are the round's attachments and their volumes.
	batch []*attachChaosItem
	ids   map[string]bool
	res   attachChaosResult
}

// runAttachChaos runs rounds rounds of e2e.ChaosRounds; t fails unless every round
// settles.
func runAttachChaos(t testing.TB, rounds int) attachChaosResult {
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodControllerPublishVolume: attachChaosLatency}})
	c := &attachChaos{scenario: s}
	run := &e2e.ChaosRounds{S: s.Scenario, Lease: s.leaseName,
		Start: func(name, id string) *e2e.Replica {
			return s.start(name, append(append([]string{"--leader-election-identity=" + id}, fastAPI...), e2e.ChaosLease...)...)
		},
		Work: c.attachAll, InFlight: c.publishing, Leaderless: c.deleteSome, Problems: c.problems, Settled: c.countUncertain,
	}
	run.Run(rounds)
	c.res.rounds, c.res.converge = run.Rounds, run.Converge
	c.count()
	return c.res
}

// attachAll creates the round's volumes, their PersistentVolumes and a VolumeAttachment of
// each to the node.
func (c *attachChaos) attachAll(round int) {
	t := c.T
	t.Helper()
	ctx := context.Background()
	c.batch, c.ids = nil, map[string]bool{}
	for i := range attachChaosVolumes {
		item := &attachChaosItem{va: fmt.Sprintf("%s-r%02d-va-%d", c.Namespace, round, i)}
		item.volumeID = c.volumeWithPV(fmt.Sprintf("r%02d-vol-%d", round, i), fmt.Sprintf("%s-r%02d-pv-%d", c.Namespace, round, i))
		c.ids[item.volumeID] = true
		c.batch = append(c.batch, item)
	}
	for i, item := range c.batch {
		pv := fmt.Sprintf("%s-r%02d-pv-%d", c.Namespace, round, i)
		va := &storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: item.va},
			Spec: storagev1.VolumeAttachmentSpec{Attacher: c.Driver.DriverName(), NodeName: c.node,
				Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(pv)}},
		}
		if _, err := c.Client.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	c.items = append(c.items, c.batch...)
}

// publishing tells whether every publish of the round runs on r.
func (c *attachChaos) publishing(_ int, calls []testdriver.Call, r *e2e.Replica) bool {
	return e2e.Running(e2e.CallsFor(calls, r, testdriver.MethodControllerPublishVolume, volumeID, c.ids)) == attachChaosVolumes
}

func volumeID(c testdriver.Call) string { return c.VolumeID }

// deleteSome deletes a third of the round's attachments while nobody leads, as the
// attach/detach controller does when the pod goes.
func (c *attachChaos) deleteSome(int) {
	for i, item := range c.batch {
		if i%3 == 0 {
			if err := c.Client.StorageV1().VolumeAttachments().Delete(context.Background(), item.va, metav1.DeleteOptions{}); err != nil {
				c.T.Fatal(err)
			}
			item.deleted = true
		}
	}
}

// countUncertain counts the publishes of the round's deleted attachments that the killed
// leader had started and the driver finished all the same.
func (c *attachChaos) countUncertain(_ int, leader *e2e.Replica) {
	deleted := map[string]bool{}
	for _, item := range c.batch {
		deleted[item.volumeID] = item.deleted
	}
	c.res.uncertain += e2e.Succeeded(e2e.CallsFor(c.Driver.Journal(), leader, testdriver.MethodControllerPublishVolume, volumeID, deleted))
}

// volumeWithPV creates a volume in the driver and its PersistentVolume, and returns the
// volume's ID.
func (c *attachChaos) volumeWithPV(volume, pvName string) string {
	c.T.Helper()
	ctx := context.Background()
	rsp, err := c.setup.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: volume, VolumeCapabilities: []*csi.VolumeCapability{mountCapability()}})
	if err != nil {
		c.T.Fatal(err)
	}
	id := rsp.GetVolume().GetVolumeId()
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: c.Driver.DriverName(), VolumeHandle: id, FSType: "ext4",
			}},
		},
	}
	if _, err := c.Client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		c.T.Fatal(err)
	}
	return id
}

// problems lists what is not settled: a deleted attachment still there or its volume
// still published to the node; a live one not attached or its volume not published.
func (c *attachChaos) problems() []string {
	vas := c.attachments()
	var out []string
	for _, item := range c.items {
		va, exists := vas[item.va]
		vol, _ := c.Driver.Volume(item.volumeID)
		_, published := vol.Published[c.nodeID]
		switch {
		case item.deleted && exists:
			out = append(out, fmt.Sprintf("deleted VolumeAttachment %s is still there (finalizers %v)", item.va, va.Finalizers))
		case item.deleted && published:
			out = append(out, fmt.Sprintf("volume %s of deleted VolumeAttachment %s is still published", item.volumeID, item.va))
		case !item.deleted && (!exists || !va.Status.Attached):
			out = append(out, fmt.Sprintf("VolumeAttachment %s is not attached", item.va))
		case !item.deleted && !published:
			out = append(out, fmt.Sprintf("volume %s of VolumeAttachment %s is not published", item.volumeID, item.va))
		}
	}
	return out
}

// count fills in the end-of-run figures.
func (c *attachChaos) count() {
	vas := c.attachments()
	for _, item := range c.items {
		c.res.attachments++
		vol, _ := c.Driver.Volume(item.volumeID)
		_, published := vol.Published[c.nodeID]
		va, exists := vas[item.va]
		switch {
		case item.deleted:
			c.res.deleted++
			if published {
				c.res.left++
			}
			if exists {
				c.res.stuck++
			}
		case !exists || !va.Status.Attached || !published:
			c.res.stuck++
		}
	}
	c.res.overlaps = len(c.Driver.Overlaps())
}

// check fails t unless the run ended clean, and logs its figures.
func (r attachChaosResult) check(t testing.TB) {
	t.Helper()
	mean, longest := e2e.MeanAndLongest(r.converge)
	t.Logf("FIGURE attacher chaos: %d rounds, %d VolumeAttachments, %d deleted while nobody led (%d of them published by the dead leader's calls)",
		r.rounds, r.attachments, r.deleted, r.uncertain)
	t.Logf("FIGURE attacher chaos: %d publications left for deleted attachments, %d attachments stuck, %d overlaps; converged %.1fs after the kill on average, %.1fs at most",
		r.left, r.stuck, r.overlaps, mean, longest)
	if r.left != 0 || r.stuck != 0 || r.overlaps != 0 {
		t.Errorf("%d publications left for deleted attachments, %d attachments stuck, %d overlaps: want 0 of each", r.left, r.stuck, r.overlaps)
	}
}

// The short attacher chaos run of `make test`: VolumeAttachments deleted while their
// publish is uncertain (the leader SIGKILLed mid-call) end detached in the driver.
func TestChaosSIGKILLWhilePublishingLeavesNoPublicationOfDeletedAttachments(t *testing.T) {
	runAttachChaos(t, 3).check(t)
}

// BenchmarkAttacherChaos is the full attacher chaos run, 20 rounds: publications left for
// deleted attachments, attachments stuck, overlaps, time from each SIGKILL to settled.
func BenchmarkAttacherChaos(b *testing.B) {
	for range b.N {
		r := runAttachChaos(b, 20)
		r.check(b)
		mean, longest := e2e.MeanAndLongest(r.converge)
		b.ReportMetric(float64(r.left), "publications-left")
		b.ReportMetric(float64(r.uncertain), "uncertain-publishes")
		b.ReportMetric(float64(r.stuck), "stuck-attachments")
		b.ReportMetric(float64(r.overlaps), "overlaps")
		b.ReportMetric(mean, "converge-s")
		b.ReportMetric(longest, "converge-max-s")
	}
}
