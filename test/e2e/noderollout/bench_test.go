package noderollout

import (
	"fmt"
	"strings"
	"testing"
	"text/tabwriter"
)

// BenchmarkRegistrationThroughRollouts runs every scenario once with csi-sidecars'
// registrar and once with the model of upstream's, one after the other on one kubelet, and
// prints for each how long the driver was missing from CSINode, whether it came back on its
// own within the watch (two renewals of the node's Lease after the last step), and whether
// a registrar was left serving a socket whose file was gone. Figures are printed (and
// reported as absent-s and came-back), never asserted.
func BenchmarkRegistrationThroughRollouts(b *testing.B) {
	n := startNode(b)
	results := map[string]map[string]result{}
	for _, sc := range scenarios {
		results[sc.key] = map[string]result{}
		for _, im := range implementations {
			b.Run(sc.key+"-"+im.short, func(b *testing.B) {
				for i := range b.N {
					r := runScenario(b, n, sc, im, fmt.Sprintf("-%d", i))
					results[sc.key][im.name] = r
					b.ReportMetric(r.absent.Seconds(), "absent-s")
					b.ReportMetric(boolMetric(r.cameBack), "came-back")
				}
			})
		}
	}
	fmt.Print(formatResults(results))
}

func boolMetric(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// formatResults is the table of every scenario's figures, ours and the model's side by side.
func formatResults(results map[string]map[string]result) string {
	var sb strings.Builder
	fmt.Fprintln(&sb, "\nnode-driver-registrar through rollouts: time the driver was missing from CSINode (times missing)")
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "scenario\tours absent (s)\tcame back\tupstream model absent (s)\tcame back\tleft serving an unlinked socket (ours/model)\t")
	for _, sc := range scenarios {
		o, oOK := results[sc.key][ours.name]
		m, mOK := results[sc.key][upstreamModel.name]
		if !oOK && !mOK {
			continue
		}
		fmt.Fprintf(tw, "%s. %s\t%s\t%s\t%s\t%s\t%s/%s\t\n", sc.key, sc.name,
			absentCell(o, oOK), backCell(o, oOK), absentCell(m, mOK), backCell(m, mOK), unlinkedCell(o, oOK), unlinkedCell(m, mOK))
	}
	_ = tw.Flush()
	fmt.Fprintln(&sb, "(the watch ends two renewals of the node's Lease after the last step: a driver still missing then counts as not back,")
	fmt.Fprintln(&sb, " and its absence runs to the end of the watch)")
	return sb.String()
}

func absentCell(r result, ok bool) string {
	if !ok {
		return "-"
	}
	return fmt.Sprintf("%.2f (%d)", r.absent.Seconds(), len(r.absences))
}

func backCell(r result, ok bool) string {
	if !ok {
		return "-"
	}
	return yesNo(r.cameBack)
}

func unlinkedCell(r result, ok bool) string {
	if !ok {
		return "-"
	}
	return yesNo(r.unlinked)
}
