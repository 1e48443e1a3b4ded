package scale

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// fastAPI lifts the replicas' client rate limits (upstream's 5/10), as the other e2e
// packages do, so that the figures show the sidecar and not client-side throttling.
var fastAPI = []string{"--kube-api-qps=200", "--kube-api-burst=400"}

// everything is what each replica's ServiceAccount may do: the benchmark is about what a
// replica asks for, not about what it is allowed.
var everything = e2e.Rules{
	Cluster:   []rbacv1.PolicyRule{e2e.Rule("*", []string{"*"}, "*")},
	Namespace: []rbacv1.PolicyRule{e2e.Rule("*", []string{"*"}, "*")},
}

// sidecar is one sidecar's part of the run: the CSI method its fresh work calls, and that
// work.
type sidecar struct {
	name   string
	method string
	flags  []string
	// work creates the fresh work and returns its items; done tells whether one is
	// finished, as the API shows it.
	work func(ctx context.Context, w *world) ([]string, error)
	done func(ctx context.Context, w *world, item string) (bool, error)
}

var sidecars = []sidecar{
	{
		name:   "attacher",
		method: testdriver.MethodControllerPublishVolume,
		flags:  []string{fmt.Sprintf("--worker-threads=%d", workers)},
		work: func(ctx context.Context, w *world) ([]string, error) {
			var items []string
			for j := range freshVolumes {
				if err := w.store.CreateAttachment(ctx, w.freshPV(j)); err != nil {
					return nil, err
				}
				items = append(items, w.store.Node+"-"+w.freshPV(j))
			}
			return items, nil
		},
		done: func(ctx context.Context, w *world, va string) (bool, error) {
			obj, err := w.Client.StorageV1().VolumeAttachments().Get(ctx, va, metav1.GetOptions{})
			return err == nil && obj.Status.Attached, err
		},
	},
	{
		name:   "provisioner",
		method: testdriver.MethodCreateVolume,
		flags:  []string{fmt.Sprintf("--worker-threads=%d", workers)},
		work: func(ctx context.Context, w *world) ([]string, error) {
			var items []string
			for j := range freshVolumes {
				name := fmt.Sprintf("new-%02d", j)
				if err := w.store.CreateClaim(ctx, name); err != nil {
					return nil, err
				}
				items = append(items, name)
			}
			return items, nil
		},
		done: func(ctx context.Context, w *world, claim string) (bool, error) {
			obj, err := w.Client.CoreV1().PersistentVolumeClaims(w.Namespace).Get(ctx, claim, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			// --volume-name-prefix pvc, the claim's whole UID.
			_, err = w.Client.CoreV1().PersistentVolumes().Get(ctx, "pvc-"+string(obj.UID), metav1.GetOptions{})
			return err == nil, nil
		},
	},
	{
		name:   "resizer",
		method: testdriver.MethodControllerExpandVolume,
		flags:  []string{fmt.Sprintf("--workers=%d", workers)},
		work: func(ctx context.Context, w *world) ([]string, error) {
			var items []string
			for j := range freshVolumes {
				if err := w.store.Expand(ctx, freshClaim(j), "2Gi"); err != nil {
					return nil, err
				}
				items = append(items, freshClaim(j))
			}
			return items, nil
		},
		done: func(ctx context.Context, w *world, claim string) (bool, error) {
			obj, err := w.Client.CoreV1().PersistentVolumeClaims(w.Namespace).Get(ctx, claim, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			c := obj.Status.Capacity[v1.ResourceStorage]
			return c.Cmp(resource.MustParse("2Gi")) >= 0, nil
		},
	},
}

// result is what one handover showed.
type result struct {
	sidecar, leader, standby string
	inFlight, exitCode       int
	drain                    time.Duration
	// takeover is from the leader's exit to the standby's first call of the work's method;
	// firstCall names the standby's first CSI call of any method after it took the Lease,
	// and after how long.
	takeover  time.Duration
	firstCall string
	// workAfterLease is from the standby's taking the Lease to its first call of the work's
	// method: what its queues had to go through first.
	workAfterLease time.Duration
	// repeated counts the standby's calls for volumes whose call the leader had completed.
	repeated int
	// req is what the standby asked the API server for in the window after it took the
	// Lease.
	window                time.Duration
	req                   requests
	leaderRSS, standbyRSS int64
}

// handover runs a leader and a warm standby of sc, gives them fresh work, SIGTERMs the
// leader while its calls run, and observes the standby for window after it took the Lease.
// Both replicas are stopped when it returns.
func (w *world) handover(sc sidecar, window time.Duration) result {
	w.T.Helper()
	ctx := context.Background()
	lease := e2e.LeaseName(sc.name, w.Driver.DriverName())
	r := result{sidecar: sc.name, leader: sc.name + "-a", standby: sc.name + "-b", window: window}
	start := func(name string) *e2e.Replica {
		kubeconfig := w.KubeconfigWithRules(name, everything)
		flags := append(append(append([]string{}, sc.flags...), fastAPI...), "--kubeconfig="+kubeconfig)
		return w.Start(name, []string{"csi-sidecars", sc.name}, flags...)
	}
	leader := start(r.leader)
	w.WaitForHolder(lease, r.leader)
	leader.WaitReady(w.T)
	standby := start(r.standby)
	standby.WaitReady(w.T)

	items, err := sc.work(ctx, w)
	if err != nil {
		w.T.Fatalf("%s: creating the work: %v", sc.name, err)
	}
	w.WaitForCalls(fmt.Sprintf("%d %s calls in flight on %s", workers, sc.method, r.leader), func(c []testdriver.Call) bool {
		return e2e.Running(e2e.CallsOn(c, leader, sc.method)) >= workers
	})
	r.inFlight = e2e.Running(e2e.CallsOn(w.Driver.Journal(), leader, sc.method))
	r.leaderRSS = leader.PeakRSS()
	signalled := leader.Signal(w.T, syscall.SIGTERM)
	r.exitCode = leader.Wait(w.T, time.Minute)
	r.drain = leader.ExitedAt.Sub(signalled)

	w.WaitForHolder(lease, r.standby)
	acquired := w.Lease(lease).Spec.AcquireTime
	if acquired == nil {
		w.T.Fatalf("%s: Lease %s held by %s has no acquire time", sc.name, lease, r.standby)
	}
	took := acquired.Time
	w.WaitForCalls(fmt.Sprintf("the first %s of %s", sc.method, r.standby), func(c []testdriver.Call) bool {
		return len(e2e.CallsOn(c, standby, sc.method)) > 0
	})
	journal := w.Driver.Journal()
	first := e2e.CallsOn(journal, standby, sc.method)[0].Start
	r.takeover, r.workAfterLease = first.Sub(leader.ExitedAt), first.Sub(took)
	for _, c := range journal {
		if c.Socket == standby.Socket && !c.Start.Before(took) {
			r.firstCall = fmt.Sprintf("%s +%v", c.Method, c.Start.Sub(took).Round(time.Millisecond))
			break
		}
	}
	w.waitDone(ctx, sc, items)

	// Waiting out the window: it is the span of time observed, not a stand-in for an event.
	<-time.After(time.Until(took.Add(window)))
	events, err := auditUpTo(ctx, w.Client)
	if err != nil {
		w.T.Fatal(err)
	}
	r.standbyRSS = standby.PeakRSS()
	user := "system:serviceaccount:" + w.Namespace + ":" + r.standby
	r.req = requestsOf(events, user, took, took.Add(window), w.isSettled)
	r.repeated = repeated(w.Driver.Journal(), leader, standby, sc.method)

	standby.Signal(w.T, syscall.SIGTERM)
	if code := standby.Wait(w.T, time.Minute); code != 0 {
		w.T.Errorf("%s exited %d after its work, want 0", r.standby, code)
	}
	return r
}

// waitDone waits until the API shows every item finished (polling only those that are not).
func (w *world) waitDone(ctx context.Context, sc sidecar, items []string) {
	w.T.Helper()
	left := items
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		var still []string
		for _, item := range left {
			if ok, _ := sc.done(ctx, w, item); !ok {
				still = append(still, item)
			}
		}
		left = still
		return len(left) == 0, nil
	})
	if err != nil {
		w.T.Fatalf("%s: %d of %d items not done: %v (%v)", sc.name, len(left), len(items), err, left)
	}
}

// repeated counts the standby's calls of method on volumes (by name for CreateVolume) whose
// call the leader had completed.
func repeated(journal []testdriver.Call, leader, standby *e2e.Replica, method string) int {
	key := func(c testdriver.Call) string {
		if method == testdriver.MethodCreateVolume {
			return c.VolumeName
		}
		return c.VolumeID
	}
	completed := map[string]bool{}
	for _, c := range e2e.CallsOn(journal, leader, method) {
		if c.Code == "OK" {
			completed[key(c)] = true
		}
	}
	n := 0
	for _, c := range e2e.CallsOn(journal, standby, method) {
		if completed[key(c)] {
			n++
		}
	}
	return n
}

func mib(b int64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

// table prints one line per handover and, under them, every request of each new leader in
// its window by verb and resource: nine lines, so that a benchmark's log (cut after ten
// without -v) shows all of it. setup is how long creating the settled volumes took.
func table(n int, setup string, results []result) string {
	var b strings.Builder
	window := time.Duration(0)
	if len(results) > 0 {
		window = results[0].window
	}
	fmt.Fprintf(&b, "handover with %d settled volumes (bound, attached; setup %s), %d fresh items per sidecar, driver latency %v; the new leader's requests in its first %v, from the audit log:\n",
		n, setup, freshVolumes, driverLatency, window)
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "sidecar\tleader -> standby\tin flight\tdrain\texit\ttakeover\tfirst call after Lease\twork call after Lease\tLISTs\twrites\tto settled objects\tLease writes\tfailed\trepeated calls\tleader peak RSS\tstandby peak RSS")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%s -> %s\t%d\t%v\t%d\t%v\t%s\t%v\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", r.sidecar, r.leader, r.standby, r.inFlight,
			r.drain.Round(time.Millisecond), r.exitCode, r.takeover.Round(time.Millisecond), r.firstCall, r.workAfterLease.Round(time.Millisecond),
			sum(r.req.lists), sum(r.req.writes), sum(r.req.settledWrites), r.req.leaseWrites, r.req.failed, r.repeated,
			mib(r.leaderRSS), mib(r.standbyRSS))
	}
	tw.Flush()
	for _, r := range results {
		fmt.Fprintf(&b, "%s (%d requests): %s\n", r.standby, len(r.req.all), format(r.req.byKind))
	}
	b.WriteString("(takeover: from the leader's exit to the standby's first call of the work's method, negative when before the exit, as the old process " +
		"releases the Lease last; writes: all but the Lease's; repeated calls: the standby's, for volumes the leader had done)")
	return b.String()
}
