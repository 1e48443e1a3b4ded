package capacity

import "k8s.io/component-base/metrics"

// collector reports a Tracker's counts with upstream's metric names (P9),
// computed when scraped. Its descriptors are its own: several trackers (tests) may live in
// one process.
type collector struct {
	metrics.BaseStableCollector
	tracker                 *Tracker
	goal, current, obsolete *metrics.Desc
}

func NewCollector(t *Tracker) *collector {
	return &collector{
		tracker: t,
		goal: metrics.NewDesc("csistoragecapacities_desired_goal",
			"Number of CSIStorageCapacity objects that are supposed to be managed automatically.", nil, nil, metrics.ALPHA, ""),
		current: metrics.NewDesc("csistoragecapacities_desired_current",
			"Number of CSIStorageCapacity objects that exist and are supposed to be managed automatically.", nil, nil, metrics.ALPHA, ""),
		obsolete: metrics.NewDesc("csistoragecapacities_obsolete",
			"Number of CSIStorageCapacity objects that exist and will be deleted automatically.", nil, nil, metrics.ALPHA, ""),
	}
}

func (c *collector) DescribeWithStability(ch chan<- *metrics.Desc) {
	ch <- c.goal
	ch <- c.current
	ch <- c.obsolete
}

func (c *collector) CollectWithStability(ch chan<- metrics.Metric) {
	goal, current, obsolete := c.tracker.counts()
	ch <- metrics.NewLazyConstMetric(c.goal, metrics.GaugeValue, float64(goal))
	ch <- metrics.NewLazyConstMetric(c.current, metrics.GaugeValue, float64(current))
	ch <- metrics.NewLazyConstMetric(c.obsolete, metrics.GaugeValue, float64(obsolete))
}
