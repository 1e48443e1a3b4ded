package healthmonitor

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/audit"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
)

var (
	flagVolumes   = flag.Int("healthmonitor.volumes", 1000, "BenchmarkHealthMonitor: bound volumes")
	flagPasses    = flag.Int("healthmonitor.passes", 10, "BenchmarkHealthMonitor: list passes (--list-volumes-interval each) whose writes are counted")
	flagReports   = flag.Int("healthmonitor.reports", 5, "BenchmarkHealthMonitor: volumes turned abnormal and healthy again, one at a time, for the time to the claim")
	flagPageSize  = flag.Int("healthmonitor.page-size", 100, "BenchmarkHealthMonitor: the driver's own cap on a ControllerListVolumeHealth page")
	setupWorkers  = 32
	reportTimeout = 30 * time.Second
)

// BenchmarkHealthMonitor runs the health monitor (--list-volumes-interval=1s) on 1,000
// bound volumes of a driver with LIST_VOLUME_HEALTH that pages its list, the API server's
// CSIVolumeHealth gate on. It prints and reports:
//
//   - the monitor's API writes per interval while every volume is healthy (target 0),
//     from the audit log by user agent, the Lease's writes apart, over several passes;
//     the claims' resourceVersions must agree;
//   - the time from a driver's report (SetVolumeHealth) to the claim's
//     status.healthStatus showing it, seen through a watch of the claim, for a few volumes
//     turned abnormal and then healthy again one at a time.
//
// Figures are printed, never asserted.
func BenchmarkHealthMonitor(b *testing.B) {
	e2e.RequireBinaries(b, binDir)
	if auditLog == "" {
		b.Skip("no audit log: benchmarks run with a control plane only")
	}
	for range b.N {
		benchHealthMonitor(b)
	}
}

func benchHealthMonitor(b *testing.B) {
	ctx := context.Background()
	cfg := healthDriver()
	cfg.HealthPageSize = *flagPageSize
	s := newScenario(b, kube.Get(b), cfg)
	fast := s.CP.Config()
	fast.ContentType = "application/vnd.kubernetes.protobuf"
	client := kubernetes.NewForConfigOrDie(fast)

	start := time.Now()
	pairs, err := s.makePairs(ctx, client, *flagVolumes)
	b.Cleanup(func() { s.deletePairs(client) })
	if err != nil {
		b.Fatal(err)
	}
	fmt.Printf("health monitor: %d bound PV/claim pairs made in %v\n", len(pairs), time.Since(start).Round(100*time.Millisecond))

	r := s.startReplica("r1")
	s.WaitForHolder(s.leaseName, "r1")
	r.WaitReady(b)
	s.passes(2)

	// Writes while every volume is healthy.
	before := s.allVersions(ctx, client)
	from := time.Now()
	s.passes(*flagPasses)
	to := time.Now()
	after := s.allVersions(ctx, client)
	changed := 0
	for n, rv := range before {
		if after[n] != rv {
			changed++
		}
	}
	writes, leaseWrites, err := s.writesBetween(ctx, from, to)
	if err != nil {
		b.Fatal(err)
	}
	writes.Ops, leaseWrites.Ops = *flagPasses, *flagPasses
	elapsed := to.Sub(from)
	fmt.Printf("health monitor: %d healthy volumes, %d list passes (--list-volumes-interval=1s, pages of %d) in %v: %d API writes (%s per interval; %s), Lease writes %d; %d of %d claims' resourceVersions changed\n",
		len(pairs), *flagPasses, *flagPageSize, elapsed.Round(10*time.Millisecond), writes.Writes, writes.PerOpString(), kindsOrNone(writes), leaseWrites.Writes, changed, len(before))

	// The time from a report to the claim. Each report comes at a random moment of the
	// interval: one right after the claim showed the last would come right after a pass.
	var abnormal, healthy []time.Duration
	reportsFrom := time.Now()
	for i := range *flagReports {
		p := pairs[i*(len(pairs)-1)/max(1, *flagReports-1)]
		time.Sleep(rand.N(time.Second))
		d, err := s.shownAfter(ctx, p, func() error { return s.Driver.SetVolumeHealth(p.volumeID, degraded) },
			func(c *v1.PersistentVolumeClaim) bool { return c.Status.HealthStatus != nil })
		if err != nil {
			b.Fatal(err)
		}
		abnormal = append(abnormal, d)
		time.Sleep(rand.N(time.Second))
		d, err = s.shownAfter(ctx, p, func() error { return s.Driver.SetVolumeHealth(p.volumeID) },
			func(c *v1.PersistentVolumeClaim) bool { return c.Status.HealthStatus == nil })
		if err != nil {
			b.Fatal(err)
		}
		healthy = append(healthy, d)
	}
	if !r.Running() {
		b.Fatalf("the monitor exited (%d)", r.ExitCode)
	}
	reportWrites, err := s.writesSince(ctx, reportsFrom)
	if err != nil {
		b.Fatal(err)
	}
	am, ax := e2e.MeanAndLongest(abnormal)
	hm, hx := e2e.MeanAndLongest(healthy)
	fmt.Printf("health monitor: report to claim, %d volumes of %d one at a time: abnormal shown after %s (mean %.2f s, longest %.2f s); healthy again shown after %s (mean %.2f s, longest %.2f s); %d writes meanwhile (%s)\n",
		len(abnormal), len(pairs), seconds(abnormal), am, ax, seconds(healthy), hm, hx, reportWrites.Writes, kindsOrNone(reportWrites))

	b.ReportMetric(writes.PerOp(), "writes/interval")
	b.ReportMetric(float64(leaseWrites.Writes)/elapsed.Seconds(), "lease-writes/s")
	b.ReportMetric(float64(changed), "claims-changed")
	b.ReportMetric(am, "report-to-abnormal-mean-s")
	b.ReportMetric(ax, "report-to-abnormal-max-s")
	b.ReportMetric(hm, "report-to-healthy-mean-s")
	b.ReportMetric(hx, "report-to-healthy-max-s")
}

// writesBetween tallies the writes of csi-sidecars processes received from from to to,
// those of Leases apart.
func (s *scenario) writesBetween(ctx context.Context, from, to time.Time) (writes, leaseWrites *audit.Tally, err error) {
	events, err := audit.UpTo(ctx, s.Client, auditLog)
	if err != nil {
		return nil, nil, err
	}
	writes, leaseWrites = audit.NewTally(), audit.NewTally()
	for _, e := range events {
		if !e.IsWrite() || e.RequestReceived.Before(from) || e.RequestReceived.After(to) || !isOurs(e) {
			continue
		}
		if e.Resource() == "leases" {
			leaseWrites.Add(e)
			continue
		}
		writes.Add(e)
	}
	return writes, leaseWrites, nil
}

// writesSince is writesBetween from since to now, the Lease's writes left out.
func (s *scenario) writesSince(ctx context.Context, since time.Time) (*audit.Tally, error) {
	w, _, err := s.writesBetween(ctx, since, time.Now())
	return w, err
}

// isOurs tells whether a request came from a csi-sidecars process: its sidecars' own
// clients add their name to the process's user agent.
func isOurs(e audit.Event) bool {
	return e.UserAgent == "csi-sidecars" || strings.HasPrefix(e.UserAgent, "csi-sidecars/")
}

func kindsOrNone(t *audit.Tally) string {
	if t.Writes == 0 {
		return "none"
	}
	return t.Kinds()
}

func seconds(ds []time.Duration) string {
	parts := make([]string, len(ds))
	for i, d := range ds {
		parts[i] = fmt.Sprintf("%.2f", d.Seconds())
	}
	return strings.Join(parts, ", ") + " s"
}

// makePairs makes n bound pairs named v-0000.. from several goroutines.
func (s *scenario) makePairs(ctx context.Context, client kubernetes.Interface, n int) ([]pair, error) {
	pairs := make([]pair, n)
	next := make(chan int)
	errs := make([]error, setupWorkers)
	var wg sync.WaitGroup
	for w := range setupWorkers {
		wg.Go(func() {
			for i := range next {
				if errs[w] != nil {
					continue
				}
				pairs[i], errs[w] = s.makePair(ctx, client, fmt.Sprintf("v-%04d", i))
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return pairs, errors.Join(errs...)
}

// deletePairs deletes the scenario's PVs and claims.
func (s *scenario) deletePairs(client kubernetes.Interface) {
	ctx := context.Background()
	sel := metav1.ListOptions{LabelSelector: pairLabel + "=" + s.Namespace}
	if err := client.CoreV1().PersistentVolumes().DeleteCollection(ctx, metav1.DeleteOptions{}, sel); err != nil {
		s.T.Logf("deleting the PVs: %v", err)
	}
	if err := client.CoreV1().PersistentVolumeClaims(s.Namespace).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		s.T.Logf("deleting the claims: %v", err)
	}
}

// allVersions are the resourceVersions of the namespace's claims, by name.
func (s *scenario) allVersions(ctx context.Context, client kubernetes.Interface) map[string]string {
	s.T.Helper()
	list, err := client.CoreV1().PersistentVolumeClaims(s.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	out := make(map[string]string, len(list.Items))
	for _, c := range list.Items {
		out[c.Name] = c.ResourceVersion
	}
	return out
}

// shownAfter calls report and returns how long after it a watch of p's claim saw shown
// accept the claim.
func (s *scenario) shownAfter(ctx context.Context, p pair, report func() error, shown func(*v1.PersistentVolumeClaim) bool) (time.Duration, error) {
	claims := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace)
	cur, err := claims.Get(ctx, p.claim, metav1.GetOptions{})
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, reportTimeout)
	defer cancel()
	w, err := claims.Watch(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", p.claim).String(),
		ResourceVersion: cur.ResourceVersion})
	if err != nil {
		return 0, fmt.Errorf("watching claim %s: %w", p.claim, err)
	}
	defer w.Stop()
	at := time.Now()
	if err := report(); err != nil {
		return 0, err
	}
	for {
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("claim %s did not show the driver's report within %v", p.claim, reportTimeout)
		case ev, ok := <-w.ResultChan():
			if !ok {
				return 0, fmt.Errorf("the watch of claim %s ended", p.claim)
			}
			if ev.Type == watch.Error {
				return 0, fmt.Errorf("watch of claim %s: %v", p.claim, ev.Object)
			}
			if c, ok := ev.Object.(*v1.PersistentVolumeClaim); ok && shown(c) {
				return time.Since(at), nil
			}
		}
	}
}
