package lifecycle

import (
	"k8s.io/component-base/metrics"
)

// coreMetrics are the core's own metrics, registered on the process's one registry (the CSI
// metrics manager's), beside csi_sidecar_operations_seconds.
type coreMetrics struct {
	drainDuration *metrics.HistogramVec
	inflight      *metrics.GaugeVec
	leader        *metrics.GaugeVec
}

func newCoreMetrics(reg metrics.KubeRegistry) *coreMetrics {
	m := &coreMetrics{
		drainDuration: metrics.NewHistogramVec(&metrics.HistogramOpts{
			Namespace:      "csi_sidecars",
			Name:           "drain_duration_seconds",
			Help:           "Time from the first termination signal until every in-flight operation of a leading sidecar ended, by outcome (released: the Lease is released next; deadline: --drain-timeout ran out). Recorded before the Lease is written.",
			Buckets:        []float64{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120},
			StabilityLevel: metrics.ALPHA,
		}, []string{"sidecar", "outcome"}),
		inflight: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace:      "csi_sidecars",
			Name:           "inflight_operations",
			Help:           "CSI calls in flight, by sidecar.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"sidecar"}),
		leader: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace:      "csi_sidecars",
			Name:           "leader",
			Help:           "1 while this replica leads for the sidecar (or runs it without leader election), else 0.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"sidecar"}),
	}
	reg.MustRegister(m.drainDuration, m.inflight, m.leader)
	return m
}
