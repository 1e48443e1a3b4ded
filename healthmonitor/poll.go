package healthmonitor

import (
	"context"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/klog/v2"
)

// healthClient is the part of the CSI Controller service the monitor calls.
type healthClient interface {
	ControllerGetVolumeHealth(ctx context.Context, in *csi.ControllerGetVolumeHealthRequest, opts ...grpc.CallOption) (*csi.ControllerGetVolumeHealthResponse, error)
	ControllerListVolumeHealth(ctx context.Context, in *csi.ControllerListVolumeHealthRequest, opts ...grpc.CallOption) (*csi.ControllerListVolumeHealthResponse, error)
}

// poller asks the driver for the health of the driver's bound volumes and hands each
// answer to the reporter.
type poller struct {
	driver   string
	client   healthClient
	pvs      corelisters.PersistentVolumeLister
	reporter *reporter
	// timeout bounds each CSI call.
	timeout time.Duration
	// ops is the context of the CSI calls and the writes that record their answers.
	ops func() context.Context
}

// boundVolumes are the driver's PersistentVolumes that are bound to a claim and not being
// deleted, by volume handle.
func (p *poller) boundVolumes() map[string]*v1.PersistentVolume {
	pvs, err := p.pvs.List(labels.Everything())
	if err != nil {
		return nil // a lister over a cache does not fail
	}
	out := make(map[string]*v1.PersistentVolume, len(pvs))
	for _, pv := range pvs {
		if monitored(pv, p.driver) {
			out[pv.Spec.CSI.VolumeHandle] = pv
		}
	}
	return out
}

// monitored tells whether the monitor checks pv: a bound volume of driver, not being
// deleted.
func monitored(pv *v1.PersistentVolume, driver string) bool {
	return pv.Spec.CSI != nil && pv.Spec.CSI.Driver == driver && pv.Spec.CSI.VolumeHandle != "" &&
		pv.Status.Phase == v1.VolumeBound && pv.Spec.ClaimRef != nil && pv.DeletionTimestamp == nil
}

// listPass runs one ControllerListVolumeHealth pass over all pages. Each listed volume is
// reported abnormal as its page comes; once the last page is in, every other bound volume
// is reported healthy, since the driver lists only abnormal volumes. From the end of intake
// no further page is asked for: the call in the driver finishes on Ops() and its answer is
// recorded (P1), but an incomplete pass declares nothing healthy.
func (p *poller) listPass(intake context.Context) {
	ops := p.ops()
	logger := klog.FromContext(ops)
	volumes := p.boundVolumes()
	listed := map[string]bool{}
	token := ""
	for pages := 0; ; pages++ {
		if intake.Err() != nil {
			logger.V(2).Info("Volume health pass cut short by shutdown", "pages", pages)
			return
		}
		ctx, cancel := context.WithTimeout(ops, p.timeout)
		rsp, err := p.client.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{StartingToken: token})
		cancel()
		if err != nil {
			logger.Error(err, "ControllerListVolumeHealth failed: the pass is retried at the next interval", "pages", pages)
			return
		}
		for _, e := range rsp.GetEntries() {
			id := e.GetVolumeId()
			listed[id] = true
			pv, ok := volumes[id]
			if !ok {
				continue // not a bound volume of a claim: nothing to report on
			}
			p.record(ops, pv, e.GetHealthStatuses())
		}
		if token = rsp.GetNextToken(); token == "" {
			break
		}
	}
	for id, pv := range volumes {
		if !listed[id] {
			p.record(ops, pv, nil)
		}
	}
}

// checkVolume asks the driver for the health of one PersistentVolume, by name, and
// records it. A failed call is logged and left to the next interval.
func (p *poller) checkVolume(name string) error {
	pv, err := p.pvs.Get(name)
	if err != nil || !monitored(pv, p.driver) {
		return nil // deleted or unbound since it was queued
	}
	ops := p.ops()
	ctx, cancel := context.WithTimeout(ops, p.timeout)
	rsp, err := p.client.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: pv.Spec.CSI.VolumeHandle})
	cancel()
	switch {
	case status.Code(err) == codes.NotFound:
		klog.FromContext(ops).V(2).Info("The driver does not know the volume (deleted?): not reported", "pv", pv.Name, "volumeHandle", pv.Spec.CSI.VolumeHandle)
		return nil
	case err != nil:
		klog.FromContext(ops).Error(err, "ControllerGetVolumeHealth failed: retried at the next interval", "pv", pv.Name)
		return nil
	}
	p.record(ops, pv, rsp.GetVolumeHealth().GetHealthStatuses())
	return nil
}

// record maps a driver's answer and reports it. A failed write is logged: the next
// interval finds the claim still different and writes again.
func (p *poller) record(ctx context.Context, pv *v1.PersistentVolume, entries []*csi.VolumeHealth_VolumeHealthEntry) {
	conds, unknown := conditionsOf(entries)
	logger := klog.FromContext(ctx)
	if len(unknown) > 0 {
		logger.Info("Volume health conditions of types Kubernetes does not know are not reported", "pv", pv.Name, "conditions", unknown)
	}
	if err := p.reporter.report(ctx, pv, conds); err != nil {
		logger.Error(err, "Recording volume health failed: retried at the next interval", "pv", pv.Name)
	}
}

// every runs f at once and then every interval until intake ends; a run still going when
// the next is due delays it.
func every(intake context.Context, interval time.Duration, f func()) {
	if interval <= 0 {
		interval = time.Second
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		f()
		select {
		case <-intake.Done():
			return
		case <-t.C:
		}
	}
}
