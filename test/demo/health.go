package main

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The health-monitor's intervals in the demo; its defaults are 5m and 1m. With the
// driver's LIST_VOLUME_HEALTH the list pass is the one that runs.
const (
	listInterval    = "--list-volumes-interval=2s"
	monitorInterval = "--monitor-interval=2s"
)

// unhealthy is the condition the demo gives a volume in the driver.
var unhealthy = testdriver.HealthCondition{
	Status:  csi.VolumeHealthErrorType_DATA_LOSS,
	Reason:  "ChecksumMismatch",
	Message: "blocks failed their checksum (set by the demo)",
}

func healthCapabilities() []csi.ControllerServiceCapability_RPC_Type {
	return []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH,
	}
}

// volumeHealth is what the health part saw of one claim.
type volumeHealth struct {
	claim, volume string
	// where the claim showed the health: "status.healthStatus" or "events".
	where string
	// shownUnhealthy and shownHealthy: from the driver's change to the claim showing it.
	shownUnhealthy, shownHealthy time.Duration
	// condition is the condition the claim showed, as status/reason.
	condition string
}

// volumeHealth makes the volume of claim name unhealthy in the driver, waits until the claim
// shows it, makes it healthy again and waits until the claim shows that too.
func (d *demo) volumeHealth(ctx context.Context, name string) (volumeHealth, error) {
	it, ok := d.work.Item(name)
	if !ok || it.VolumeHandle == "" {
		return volumeHealth{}, fmt.Errorf("claim %s has no volume", name)
	}
	h := volumeHealth{claim: name, volume: it.VolumeHandle}
	fmt.Fprintf(d.out, "\n== volume health: health-monitor (%s %s), the driver with GET_VOLUME_HEALTH and LIST_VOLUME_HEALTH\n",
		listInterval, monitorInterval)
	if err := d.driver.SetVolumeHealth(h.volume, unhealthy); err != nil {
		return h, err
	}
	since := time.Now()
	d.say("in the driver: volume %s of claim %s/%s has %s/%s", h.volume, d.namespace, name, unhealthy.Status, unhealthy.Reason)
	if err := d.waitFor(ctx, "claim "+name+" shows the condition", func() (bool, error) {
		var err error
		h.condition, h.where, err = d.claimHealth(ctx, name, since)
		return h.condition != "", err
	}); err != nil {
		return h, err
	}
	h.shownUnhealthy = time.Since(since)
	d.say("claim %s shows %s in %s, %v after the driver's change", name, h.condition, h.where, h.shownUnhealthy.Round(time.Millisecond))

	if err := d.driver.SetVolumeHealth(h.volume); err != nil {
		return h, err
	}
	since = time.Now()
	d.say("in the driver: volume %s healthy again", h.volume)
	if err := d.waitFor(ctx, "claim "+name+" shows it healthy", func() (bool, error) {
		if h.where == "events" {
			// No event says nothing: wait for VolumeConditionNormal.
			last, err := d.lastHealthEvent(ctx, name, since)
			return last != nil && last.Reason == "VolumeConditionNormal", err
		}
		condition, _, err := d.claimHealth(ctx, name, since)
		return condition == "", err
	}); err != nil {
		return h, err
	}
	h.shownHealthy = time.Since(since)
	d.say("claim %s shows no condition any more, %v after the driver's change", name, h.shownHealthy.Round(time.Millisecond))
	return h, nil
}

// claimHealth is the condition claim name shows now ("" if none) and where it shows it: in
// status.healthStatus where the API server keeps that field, else in the last of the
// health-monitor's events since the given time (VolumeConditionAbnormal shows one,
// VolumeConditionNormal none).
func (d *demo) claimHealth(ctx context.Context, name string, since time.Time) (condition, where string, err error) {
	claim, err := d.kube.CoreV1().PersistentVolumeClaims(d.namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return "", "", err
	}
	if hs := claim.Status.HealthStatus; hs != nil && len(hs.HealthConditions) > 0 {
		c := hs.HealthConditions[0]
		return fmt.Sprintf("%s/%s", c.Status, c.Reason), "status.healthStatus", nil
	}
	last, err := d.lastHealthEvent(ctx, name, since)
	if err != nil || last == nil {
		return "", "status.healthStatus", err
	}
	if last.Reason == "VolumeConditionAbnormal" {
		return last.Reason + ": " + last.Message, "events", nil
	}
	return "", "events", nil
}

// lastHealthEvent is the health-monitor's last event on claim name since the given time;
// nil if none.
func (d *demo) lastHealthEvent(ctx context.Context, name string, since time.Time) (*corev1.Event, error) {
	events, err := d.kube.CoreV1().Events(d.namespace).List(ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.kind=PersistentVolumeClaim,involvedObject.name=" + name,
	})
	if err != nil {
		return nil, err
	}
	var recent []corev1.Event
	for _, e := range events.Items {
		if (e.Reason == "VolumeConditionAbnormal" || e.Reason == "VolumeConditionNormal") && !eventTime(e).Before(since.Truncate(time.Second)) {
			recent = append(recent, e)
		}
	}
	if len(recent) == 0 {
		return nil, nil
	}
	last := slices.MaxFunc(recent, func(a, b corev1.Event) int { return eventTime(a).Compare(eventTime(b)) })
	return &last, nil
}

func eventTime(e corev1.Event) time.Time {
	if !e.LastTimestamp.IsZero() {
		return e.LastTimestamp.Time
	}
	if !e.EventTime.IsZero() {
		return e.EventTime.Time
	}
	return e.CreationTimestamp.Time
}
