package main

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/csi-sidecars/csi-sidecars/internal/testdriver"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// runCombined does the single-sidecar run's work again with two replicas of one process
// that hosts all three sidecars. combined-a leads the three Leases and provisions a first
// set of volumes; then it gets work for all three sidecars at once (more claims, and an
// attachment and an expansion of each volume) and, with calls of each sidecar in flight,
// one SIGTERM. It returns a handover per sidecar, whose standby is whoever holds the
// sidecar's Lease at the end, and the peak memory of combined-b once it finished the work.
func (d *demo) runCombined(ctx context.Context) (results []handover, peak int64, err error) {
	sanitized := lifecycle.SanitizeName(d.driver.DriverName())
	jobs := []struct {
		sidecar, lease, method string
		done                   func(context.Context) (int, error)
	}{
		{"provisioner", sanitized, testdriver.MethodCreateVolume, d.countMoreProvisioned},
		{"attacher", "external-attacher-leader-" + sanitized, testdriver.MethodControllerPublishVolume, d.countAttached},
		{"resizer", "external-resizer-" + sanitized, testdriver.MethodControllerExpandVolume, d.countExpanded},
	}
	var leases []string
	for _, j := range jobs {
		leases = append(leases, j.lease)
	}
	// The same number of workers per sidecar as the single-sidecar run, each flag spelled
	// with its sidecar's name as prefix; each sidecar keeps its own API rate limits, as in
	// the single-sidecar run.
	args := []string{controllers, "--provisioner-worker-threads=2", "--attacher-worker-threads=2", "--resizer-workers=2"}
	if err := d.startPair(ctx, "combined", args, leases); err != nil {
		return nil, 0, err
	}
	leader, standby := d.pair("combined", d.holder(ctx, sanitized))
	if leader == nil || standby == nil {
		return nil, 0, fmt.Errorf("no combined replica holds Lease %s", sanitized)
	}

	// Attaching and expanding need provisioned, bound volumes: the leader makes them first.
	if err := d.createClaims(ctx); err != nil {
		return nil, 0, err
	}
	if err := d.waitFor(ctx, fmt.Sprintf("%s provisioned %d volumes", leader.name, d.o.volumes), func() (bool, error) {
		n, err := d.countProvisioned(ctx)
		return n >= d.o.volumes && running(calls(d.driver.Journal(), leader.socket, testdriver.MethodCreateVolume)) == 0, err
	}); err != nil {
		return nil, 0, err
	}
	d.say("%s provisioned %d volumes", leader.name, d.o.volumes)
	if err := d.bindAll(ctx); err != nil {
		return nil, 0, err
	}

	// Work for all three at once. The attachments come first: they are for the volumes
	// provisioned so far, not for those the new claims will bring.
	if err := d.createAttachments(ctx); err != nil {
		return nil, 0, err
	}
	if err := d.expandClaims(ctx); err != nil {
		return nil, 0, err
	}
	if err := d.createMoreClaims(ctx); err != nil {
		return nil, 0, err
	}
	if err := d.waitCalls(ctx, func(c []testdriver.Call) bool {
		for _, j := range jobs {
			if running(calls(c, leader.socket, j.method)) < 2 {
				return false
			}
		}
		return true
	}); err != nil {
		return nil, 0, err
	}
	journal := d.driver.Journal()
	var inFlight []string
	for _, j := range jobs {
		h := handover{sidecar: j.sidecar, method: j.method, leader: leader.name, all: d.o.volumes,
			inFlight: running(calls(journal, leader.socket, j.method))}
		results = append(results, h)
		inFlight = append(inFlight, fmt.Sprintf("%d %s", h.inFlight, j.method))
	}
	signalled := time.Now()
	_ = leader.cmd.Process.Signal(syscall.SIGTERM)
	d.say("one SIGTERM -> %s with %s calls in flight", leader.name, strings.Join(inFlight, ", "))
	select {
	case <-leader.done:
	case <-ctx.Done():
		return results, 0, ctx.Err()
	}
	drain := leader.exited.Sub(signalled)
	ok, total := 0, 0
	for _, j := range jobs {
		for _, c := range calls(d.driver.Journal(), leader.socket, j.method) {
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
		if err := d.waitCalls(ctx, func(c []testdriver.Call) bool { return len(calls(c, standby.socket, j.method)) > 0 }); err != nil {
			return results, 0, fmt.Errorf("%s: %w", j.sidecar, err)
		}
		h.firstCallAfterExit = calls(d.driver.Journal(), standby.socket, j.method)[0].Start.Sub(leader.exited)
		d.say("%s took over the %s: first %s %v after %s exited", standby.name, j.sidecar, j.method, h.firstCallAfterExit.Round(time.Millisecond), leader.name)
	}
	for i, j := range jobs {
		h := &results[i]
		err := d.waitFor(ctx, fmt.Sprintf("%s: all %d volumes done", j.sidecar, h.all), func() (bool, error) {
			n, err := j.done(ctx)
			h.done = n
			return n >= h.all && running(calls(d.driver.Journal(), standby.socket, j.method)) == 0, err
		})
		// Who holds the Lease now, rather than who was meant to: the summary shows the
		// handover that happened.
		h.standby = d.holder(ctx, j.lease)
		// As in the single-sidecar run, only overlaps of the sidecar's own calls count.
		for _, o := range d.driver.Overlaps() {
			if o.First.Method == j.method && o.Second.Method == j.method {
				h.overlaps++
			}
		}
		d.say("%s: %d/%d done, Lease %s held by %s, %d overlapping operations in the driver", j.sidecar, h.done, h.all, j.lease, h.standby, h.overlaps)
		if err != nil {
			return results, 0, fmt.Errorf("%s: %w", j.sidecar, err)
		}
	}
	return results, peakRSS(standby.cmd.Process.Pid), nil
}

// combinedSummary is the combined run's table, and its memory beside the single-sidecar
// standbys' that did the same work.
func (d *demo) combinedSummary(rep report) {
	fmt.Fprintf(d.out, "\nSummary, combined (csi-sidecars %s: one SIGTERM for all three, calls of each in flight)\n", controllers)
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
	fmt.Fprintf(d.out, "Peak RSS of the standby that finished the work: combined-b (three sidecars, one process) %.0f MiB;\n", mib(rep.combinedPeakRSS))
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

// createMoreClaims gives the provisioner of the combined run work while the first volumes
// are attached and expanded.
func (d *demo) createMoreClaims(ctx context.Context) error {
	for i := range d.o.volumes {
		if err := d.store.CreateClaim(ctx, fmt.Sprintf("more-%02d", i)); err != nil {
			return err
		}
	}
	d.say("created %d more PVCs", d.o.volumes)
	return nil
}

func (d *demo) countMoreProvisioned(ctx context.Context) (int, error) {
	pvs, err := d.store.Provisioned(ctx)
	n := 0
	for _, pv := range pvs {
		if pv.Spec.ClaimRef != nil && strings.HasPrefix(pv.Spec.ClaimRef.Name, "more-") {
			n++
		}
	}
	return n, err
}
