package e2e

import (
	"fmt"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// MetricTotal parses a /metrics body (Prometheus' text format) and adds up the series of
// the metric family name whose labels include every one of labels: a counter's or a
// gauge's value, a histogram's sample count. found is false when no series matched.
func MetricTotal(body, name string, labels map[string]string) (total float64, found bool, err error) {
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		return 0, false, fmt.Errorf("parsing the metrics: %w", err)
	}
	family, ok := families[name]
	if !ok {
		return 0, false, nil
	}
	for _, m := range family.GetMetric() {
		if !hasLabels(m, labels) {
			continue
		}
		found = true
		switch {
		case m.Counter != nil:
			total += m.Counter.GetValue()
		case m.Gauge != nil:
			total += m.Gauge.GetValue()
		case m.Histogram != nil:
			total += float64(m.Histogram.GetSampleCount())
		}
	}
	return total, found, nil
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	have := map[string]string{}
	for _, l := range m.GetLabel() {
		have[l.GetName()] = l.GetValue()
	}
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	return true
}
