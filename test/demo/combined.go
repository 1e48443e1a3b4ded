package main

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/procmem"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// runCombined does the single-sidecar run's work again with two replicas of one process
// that hosts all four sidecars. combined-a leads the four Leases. Pods with new claims are
// provisioned and attached, then deleted and their volumes detached, so that the attacher,
// the resizer and the snapshotter have bound claims to work on. Then work for all four
// comes at once, in two waves: new Pods with new claims (provisioner), the deleted Pods
// created again (attacher), their claims grown (resizer) and snapshotted (snapshotter).
// With calls of each sidecar in flight, one SIGTERM; the second wave comes while combined-a
// drains. It returns a handover per sidecar, whose standby is whoever holds the sidecar's
// Lease at the end, the peak memory of combined-b once it finished the work, and what each
// replica's livenessprobe answered once started.
func (d *demo) runCombined(ctx context.Context) (results []handover, peak int64, probes map[string]int, err error) {
	sanitized, names := lifecycle.SanitizeName(d.driver.DriverName()), podNames("app", d.o.pods)
	rollout := d.rollout("external-attacher-leader-"+sanitized, names)
	jobs := []phase{
		d.provisioning(sanitized, podNames("new", d.o.pods)),
		rollout,
		d.growth("external-resizer-"+sanitized, names),
		d.snapshotting("external-snapshotter-leader-"+sanitized, names),
	}
	var leases []string
	for _, j := range jobs {
		leases = append(leases, j.lease)
	}
	// Every flag at its default; each sidecar keeps its own API rate limits, as in the
	// single-sidecar run.
	if err := d.startPair(ctx, "combined", []string{controllers}, leases, true); err != nil {
		return nil, 0, probes, err
	}
	leader, standby := d.pair("combined", d.holder(ctx, sanitized))
	if leader == nil || standby == nil {
		return nil, 0, probes, fmt.Errorf("no combined replica holds Lease %s, or it has no standby", sanitized)
	}
	// The livenessprobe runs on both replicas, the standby too: it leads nothing.
	probes = map[string]int{}
	for _, r := range []*replica{leader, standby} {
		ctx, cancel := context.WithTimeout(ctx, waitTimeout)
		probes[r.name], err = r.waitProbe(ctx)
		cancel()
		if err != nil {
			return nil, 0, probes, err
		}
		d.say("%s's livenessprobe answers %d on %s (the driver's Probe)", r.name, probes[r.name], r.probe)
	}

	for _, name := range names {
		if err := d.work.CreatePod(ctx, name); err != nil {
			return nil, 0, probes, err
		}
	}
	d.say("created Pods %s, each with a new claim: %s provisions and attaches their volumes first", span(names), leader.name)
	if err := rollout.prepare(ctx); err != nil {
		return nil, 0, probes, err
	}

	// Work for all four at once: the first wave of each, then one SIGTERM once calls of
	// each are in flight. The control loop brings each kind of work at its own pace: a kind
	// whose calls all ended before the others' came gets one more item, as long as one is
	// left for the second wave.
	since := time.Now()
	given := make([]int, len(jobs)) // items of each job given so far
	for i, j := range jobs {
		given[i] = len(j.names) / 2
		what, err := j.give(ctx, j.names[:given[i]])
		if err != nil {
			return nil, 0, probes, fmt.Errorf("%s: %w", j.sidecar, err)
		}
		d.say("%s%s", what, j.how)
	}
	for {
		var ended []int
		if err := d.waitCalls(ctx, func(c []testdriver.Call) bool {
			ended = ended[:0]
			all := true
			for i, j := range jobs {
				if cs := callsSince(c, leader.socket, j.method, since); len(cs) >= given[i] && running(cs) == 0 {
					ended = append(ended, i)
				}
				all = all && inFlight(c, leader.socket, j.method, since, given[i])
			}
			return all || len(ended) > 0
		}); err != nil {
			return nil, 0, probes, fmt.Errorf("waiting for calls of each sidecar on %s: %w", leader.name, err)
		}
		if len(ended) == 0 {
			break
		}
		for _, i := range ended {
			j := jobs[i]
			if given[i] >= len(j.names)-1 {
				return nil, 0, probes, fmt.Errorf("%s's %s calls kept ending before calls of each sidecar were in flight at once", leader.name, j.method)
			}
			what, err := j.give(ctx, j.names[given[i]:given[i]+1])
			if err != nil {
				return nil, 0, probes, fmt.Errorf("%s: %w", j.sidecar, err)
			}
			given[i]++
			d.say("%s: %s's %s calls ended before the other sidecars' calls came", what, leader.name, j.method)
		}
	}
	signalled, err := d.terminate(ctx, leader)
	if err != nil {
		return nil, 0, probes, err
	}
	journal := d.driver.Journal()
	var inFlightNow []string
	for _, j := range jobs {
		h := handover{sidecar: j.sidecar, method: j.method, leader: leader.name, all: len(j.names),
			inFlight: runningAt(callsSince(journal, leader.socket, j.method, since), signalled)}
		results = append(results, h)
		inFlightNow = append(inFlightNow, fmt.Sprintf("%d %s", h.inFlight, j.method))
	}
	d.say("one SIGTERM -> %s with %s calls in flight", leader.name, strings.Join(inFlightNow, ", "))
	for i, j := range jobs {
		what, err := j.give(ctx, j.names[given[i]:])
		if err != nil {
			return results, 0, probes, fmt.Errorf("%s: %w", j.sidecar, err)
		}
		d.say("%s while %s drains", what, leader.name)
	}
	select {
	case <-leader.done:
	case <-ctx.Done():
		return results, 0, probes, ctx.Err()
	}
	drain := leader.exited.Sub(signalled)
	ok, total := 0, 0
	for _, j := range jobs {
		for _, c := range callsSince(d.driver.Journal(), leader.socket, j.method, since) {
			total++
			if c.Code == "OK" && c.CallerGone.IsZero() {
				ok++
			}
		}
	}
	d.say("%s exited %d after draining %v: %d/%d of its calls completed", leader.name, leader.code, drain.Round(time.Millisecond), ok, total)

	for i, j := range jobs {
		h := &results[i]
		h.drain, h.exitCode = drain, leader.code
		if err := d.waitCalls(ctx, func(c []testdriver.Call) bool { return len(callsSince(c, standby.socket, j.method, since)) > 0 }); err != nil {
			return results, 0, probes, fmt.Errorf("%s: waiting for %s's first %s: %w", j.sidecar, standby.name, j.method, err)
		}
		h.firstCallAfterExit = callsSince(d.driver.Journal(), standby.socket, j.method, since)[0].Start.Sub(leader.exited)
		d.say("%s took over the %s: first %s %v after %s exited", standby.name, j.sidecar, j.method, h.firstCallAfterExit.Round(time.Millisecond), leader.name)
	}
	for i, j := range jobs {
		h := &results[i]
		err := d.waitDone(ctx, j, j.names)
		if err == nil {
			err = d.waitCalls(ctx, func(c []testdriver.Call) bool { return running(callsSince(c, standby.socket, j.method, since)) == 0 })
		}
		h.done = d.doneCount(j, j.names)
		// Who holds the Lease now, rather than who was meant to: the summary shows the
		// handover that happened.
		h.standby = d.holder(ctx, j.lease)
		h.overlaps = d.overlaps(j.method)
		d.say("%s: %d/%d done, Lease %s held by %s, %d overlapping operations in the driver", j.sidecar, h.done, h.all, j.lease, h.standby, h.overlaps)
		if err != nil {
			return results, 0, probes, fmt.Errorf("%s: %w", j.sidecar, err)
		}
	}
	return results, procmem.Peak(standby.cmd.Process.Pid), probes, nil
}

// combinedSummary is the combined run's table, and its memory beside the single-sidecar
// standbys' that did the same work.
func (d *demo) combinedSummary(rep report) {
	fmt.Fprintf(d.out, "\nSummary, combined (csi-sidecars %s: one SIGTERM for all four, calls of each in flight)\n", controllers)
	d.table(rep.combined, false)
	fmt.Fprintln(d.out, "(drain: SIGTERM to the exit of the one process. Each sidecar in it releases its own Lease as soon")
	fmt.Fprintln(d.out, " as its own calls have finished, so its standby may start before the process has exited: a negative time.)")
	if rep.combinedPeakRSS == 0 {
		return
	}
	var sum int64
	var names, sizes []string
	for _, h := range rep.single {
		if h.standbyPeakRSS == 0 {
			return // not measured: nothing to compare with
		}
		sum += h.standbyPeakRSS
		names = append(names, h.standby)
		sizes = append(sizes, fmt.Sprintf("%.0f", mib(h.standbyPeakRSS)))
	}
	fmt.Fprintf(d.out, "Peak RSS of the standby that finished the work: combined-b (%d sidecars and the livenessprobe, one process) %.0f MiB;\n", len(rep.combined), mib(rep.combinedPeakRSS))
	fmt.Fprintf(d.out, " %s (one process each) %.0f MiB together (%s)\n", strings.Join(names, " + "), mib(sum), strings.Join(sizes, " + "))
}

func mib(bytes int64) float64 { return float64(bytes) / (1 << 20) }

// table prints one row per handover; rss adds the standby's peak memory.
func (d *demo) table(results []handover, rss bool) {
	tw := tabwriter.NewWriter(d.out, 0, 0, 2, ' ', 0)
	header := "sidecar\tleader -> standby\tin flight at SIGTERM\tdrain\texit\tstandby's first call after exit\toverlaps\tdone"
	if rss {
		header += "\tstandby peak RSS"
	}
	fmt.Fprintln(tw, header)
	for _, h := range results {
		row := fmt.Sprintf("%s\t%s -> %s\t%d\t%v\t%d\t%v\t%d\t%d/%d", h.sidecar, h.leader, h.standby, h.inFlight,
			h.drain.Round(time.Millisecond), h.exitCode, h.firstCallAfterExit.Round(time.Millisecond), h.overlaps, h.done, h.all)
		if rss {
			row += fmt.Sprintf("\t%.0f MiB", mib(h.standbyPeakRSS))
		}
		fmt.Fprintln(tw, row)
	}
	tw.Flush()
}
