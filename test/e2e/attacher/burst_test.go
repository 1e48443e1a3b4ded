package attacher

import (
	"context"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

const (
	// detachBurst VolumeAttachments are deleted at once, as when a node is drained.
	detachBurst = 200
	// unpublishLatency makes the burst last detachBurst/10 unpublish latencies with the
	// default --worker-threads (10).
	unpublishLatency = 500 * time.Millisecond
)

// Upstream's issue 761: a burst of slow detaches held every worker of upstream's one
// queue, and an attach queued behind it waited for the whole burst. Here attach and detach
// have queues of their own: a VolumeAttachment created while the burst runs is published
// as soon as the first running unpublish ends, while most of the burst has yet to start,
// and is attached before the burst is done. With one queue it would start only after the
// last queued unpublish had started.
func TestAttachDuringDetachBurst(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	ids := s.volumes(detachBurst + 1)
	a := s.start("replica-a", fastAPI...)
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)
	s.attach(detachBurst)
	s.waitAllAttached(detachBurst)

	s.Driver.SetMethodLatency(testdriver.MethodControllerUnpublishVolume, unpublishLatency)
	for i := range detachBurst {
		if err := s.Client.StorageV1().VolumeAttachments().Delete(context.Background(), s.vaName(i), metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	s.WaitForCalls("the burst's unpublishes running on every worker", func(c []testdriver.Call) bool {
		return e2e.Running(e2e.CallsOn(c, a, testdriver.MethodControllerUnpublishVolume)) == 10
	})
	created := time.Now()
	s.attachOne(detachBurst)
	s.WaitUntil("the new VolumeAttachment attached", func() bool { return s.attachments()[s.vaName(detachBurst)].Status.Attached })
	attached := time.Since(created)
	s.WaitUntil("every VolumeAttachment of the burst gone", func() bool { return len(s.attachments()) == 1 })
	burstTime := time.Since(created)

	journal := s.Driver.Journal()
	var publish testdriver.Call
	for _, c := range e2e.CallsOn(journal, a, testdriver.MethodControllerPublishVolume) {
		if c.VolumeID == ids[detachBurst] {
			publish = c
		}
	}
	if publish.Start.IsZero() || !publish.Done() || publish.Code != "OK" {
		t.Fatalf("publish of the new volume: %+v", publish)
	}
	unpublishes := e2e.CallsOn(journal, a, testdriver.MethodControllerUnpublishVolume)
	if len(unpublishes) != detachBurst {
		t.Errorf("%d unpublishes, want one per VolumeAttachment of the burst (%d)", len(unpublishes), detachBurst)
	}
	var lastStart, lastEnd time.Time
	notStarted := 0
	for _, u := range unpublishes {
		if u.Code != "OK" {
			t.Errorf("unpublish of %s: %s %s", u.VolumeID, u.Code, u.Message)
		}
		if u.Start.After(publish.Start) {
			notStarted++
		}
		if u.Start.After(lastStart) {
			lastStart = u.Start
		}
		if u.End.After(lastEnd) {
			lastEnd = u.End
		}
	}
	if !publish.Start.Before(lastStart) {
		t.Errorf("the publish started at %v, after the last unpublish of the burst started (%v): it waited behind the burst", publish.Start, lastStart)
	}
	if !publish.End.Before(lastEnd) {
		t.Errorf("the publish ended at %v, after the burst (%v)", publish.End, lastEnd)
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", len(o), o)
	}
	t.Logf("FIGURE detach burst: a new VolumeAttachment attached %v after its creation while %d VolumeAttachments were detached (unpublish %v each, --worker-threads 10); %d of the burst's unpublishes started after its publish; the burst ended %v after the creation",
		attached.Round(time.Millisecond), detachBurst, unpublishLatency, notStarted, burstTime.Round(time.Millisecond))
}

// A VolumeAttachment deleted while its publish runs is detached once the publish is
// recorded, by a detach worker: the driver sees the unpublish start after the publish
// ended, once, and the VolumeAttachment goes.
func TestDeletionDuringPublish(t *testing.T) {
	s := newScenario(t, testdriver.Config{MethodLatency: map[string]time.Duration{testdriver.MethodControllerPublishVolume: time.Second}})
	ids := s.volumes(1)
	a := s.start("replica-a", fastAPI...)
	s.WaitForHolder(s.leaseName, "replica-a")
	a.WaitReady(t)
	s.attachOne(0)
	s.WaitForCalls("the publish running", func(c []testdriver.Call) bool {
		return e2e.Running(e2e.CallsOn(c, a, testdriver.MethodControllerPublishVolume)) == 1
	})
	if err := s.Client.StorageV1().VolumeAttachments().Delete(context.Background(), s.vaName(0), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	s.WaitUntil("the VolumeAttachment gone", func() bool { return len(s.attachments()) == 0 })

	journal := s.Driver.Journal()
	publishes := e2e.CallsOn(journal, a, testdriver.MethodControllerPublishVolume)
	unpublishes := e2e.CallsOn(journal, a, testdriver.MethodControllerUnpublishVolume)
	// One publish, one unpublish, and not before the publish ended. (A second unpublish,
	// from a sync of the copy the informer still showed after the finalizer removal that
	// deleted it, happened in about a third of the runs before lifecycle.OwnWrites recorded such a deletion.)
	if len(publishes) != 1 || len(unpublishes) != 1 {
		t.Fatalf("%d publishes, %d unpublishes; want one of each", len(publishes), len(unpublishes))
	}
	for _, u := range unpublishes {
		if u.Start.Before(publishes[0].End) {
			t.Errorf("an unpublish started at %v, before the publish ended (%v)", u.Start, publishes[0].End)
		}
	}
	if v, _ := s.Driver.Volume(ids[0]); len(v.Published) != 0 {
		t.Errorf("volume still published to %v", v.Published)
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("driver saw %d overlapping operations: %+v", len(o), o)
	}
}
