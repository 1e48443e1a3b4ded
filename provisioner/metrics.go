package provisioner

import (
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"

	"k8s.io/component-base/metrics"
)

// controllerMetrics are upstream's provisioning and deletion metrics (same names and
// labels, P9), on the registry the core serves.
type controllerMetrics struct {
	provisionTotal    *metrics.CounterVec
	provisionFailed   *metrics.CounterVec
	provisionDuration *metrics.HistogramVec
	deleteTotal       *metrics.CounterVec
	deleteFailed      *metrics.CounterVec
	deleteDuration    *metrics.HistogramVec
	// Ours: the provisioning records the API server refused, and those written again.
	recordsNotKept   *metrics.CounterVec
	recordsRewritten *metrics.Counter
}

func newControllerMetrics(reg metrics.KubeRegistry) (*controllerMetrics, error) {
	counter := func(name, help string, labels ...string) *metrics.CounterVec {
		return metrics.NewCounterVec(&metrics.CounterOpts{Subsystem: "controller", Name: name, Help: help, StabilityLevel: metrics.ALPHA}, labels)
	}
	histogram := func(name, help string, labels ...string) *metrics.HistogramVec {
		return metrics.NewHistogramVec(&metrics.HistogramOpts{Subsystem: "controller", Name: name, Help: help, Buckets: metrics.DefBuckets, StabilityLevel: metrics.ALPHA}, labels)
	}
	m := &controllerMetrics{
		provisionTotal:    counter("persistentvolumeclaim_provision_total", "Total number of persistent volumes provisioned successfully. Broken down by storage class name and source of the claim.", "class", "source"),
		provisionFailed:   counter("persistentvolumeclaim_provision_failed_total", "Total number of persistent volume provision failed attempts. Broken down by storage class name and source of the claim.", "class", "source"),
		provisionDuration: histogram("persistentvolumeclaim_provision_duration_seconds", "Latency in seconds to provision persistent volumes. Failed provisioning attempts are ignored. Broken down by storage class name and source of the claim.", "class", "source"),
		deleteTotal:       counter("persistentvolume_delete_total", "Total number of persistent volumes deleted successfully. Broken down by storage class name.", "class"),
		deleteFailed:      counter("persistentvolume_delete_failed_total", "Total number of persistent volume delete failed attempts. Broken down by storage class name.", "class"),
		deleteDuration:    histogram("persistentvolume_delete_duration_seconds", "Latency in seconds to delete persistent volumes. Failed deletion attempts are ignored. Broken down by storage class name.", "class"),
		recordsNotKept: metrics.NewCounterVec(&metrics.CounterOpts{Namespace: "csi_sidecars", Subsystem: "provisioner", Name: "records_not_kept_total",
			Help: "Provisioning records the API server refused to keep (by the reason of its answer, e.g. TooManyRequests, Forbidden): those provisionings went on without protection against a crash.", StabilityLevel: metrics.ALPHA}, []string{"reason"}),
		recordsRewritten: metrics.NewCounter(&metrics.CounterOpts{Namespace: "csi_sidecars", Subsystem: "provisioner", Name: "records_rewritten_total",
			Help: "Open provisioning records written again because their events disappeared (an --event-ttl shorter than the provisioning, deleted events).", StabilityLevel: metrics.ALPHA}),
	}
	for _, c := range []metrics.Registerable{m.provisionTotal, m.provisionFailed, m.provisionDuration, m.deleteTotal, m.deleteFailed, m.deleteDuration, m.recordsNotKept, m.recordsRewritten} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *controllerMetrics) provisioned(class, source string, start time.Time, err error) {
	if err != nil {
		m.provisionFailed.WithLabelValues(class, source).Inc()
		return
	}
	m.provisionDuration.WithLabelValues(class, source).Observe(time.Since(start).Seconds())
	m.provisionTotal.WithLabelValues(class, source).Inc()
}

func (m *controllerMetrics) deleted(class string, start time.Time, err error) {
	if err != nil {
		m.deleteFailed.WithLabelValues(class).Inc()
		return
	}
	m.deleteDuration.WithLabelValues(class).Observe(time.Since(start).Seconds())
	m.deleteTotal.WithLabelValues(class).Inc()
}

// recordNotKept reports a provisioning record the API server refused: the provisioning
// goes on without it, as upstream's does, unprotected against a crash until a retry keeps
// it (P17). A metric and a log line, no event: where events are refused (a rate limit),
// one more event per claim would only take the budget from the PersistentVolumes.
func (m *controllerMetrics) recordNotKept(claim v1.ObjectReference, volume string, err error) {
	m.recordsNotKept.WithLabelValues(string(apierrors.ReasonForError(err))).Inc()
	klog.Background().Info("Warning: provisioning without a durable record, a crash before its PersistentVolume is saved may leak the volume",
		"claim", klog.KRef(claim.Namespace, claim.Name), "volume", volume, "err", err.Error())
}

func (m *controllerMetrics) recordRewritten() { m.recordsRewritten.Inc() }
