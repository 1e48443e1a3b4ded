package e2e

import (
	"context"
	"fmt"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// ChaosReplicas replicas run at all times in a chaos run: a killed one is started again.
const ChaosReplicas = 3

// ChaosLease makes a SIGKILLed leader's Lease expire within seconds.
var ChaosLease = []string{"--leader-election-lease-duration=3s", "--leader-election-renew-deadline=2s", "--leader-election-retry-period=500ms"}

// defaultChaosSettle is ChaosRounds.SettleTimeout when it is 0; a round that takes longer
// is a failure, not a figure.
const defaultChaosSettle = 90 * time.Second

// ChaosRounds is the round skeleton of the sidecars' chaos runs. ChaosReplicas replicas
// (replica-0, -1, -2, each its own identity) run; in each round, once a running replica
// holds the Lease, the sidecar's Work is created, and when its driver calls run on one
// replica (InFlight) that leader is SIGKILLed (the driver finishes the calls on its own).
// While nobody leads, Leaderless acts (users delete, the scheduler moves); then the killed
// replica is started again: under its own identity in even rounds (its container restarted
// in its pod), under a new one in odd rounds (a replacement pod). With Problems set, every
// round then waits until nothing is unsettled. What to create, how to tell the calls in
// flight and what to check are the sidecar's; the counting at the end is too.
type ChaosRounds struct {
	S *Scenario
	// Lease is the sidecar's Lease.
	Lease string
	// Start runs a replica called name under leader-election identity id.
	Start func(name, id string) *Replica
	// Work creates the round's work.
	Work func(round int)
	// InFlight tells whether the round's driver calls that the kill must catch run on r,
	// calls being the driver's journal: the one running replica it holds for is the leader
	// killed.
	InFlight func(round int, calls []testdriver.Call, r *Replica) bool
	// Leaderless, if set, runs after the leader exited and before it is started again.
	Leaderless func(round int)
	// Problems, if set, lists what is not settled yet: each round then polls it until it
	// lists nothing, for up to SettleTimeout (90 s if 0), and fails the test with what is
	// left if it does not.
	Problems      func() []string
	SettleTimeout time.Duration
	// Settled, if set, runs at the end of each round with the replica killed in it.
	Settled func(round int, killed *Replica)

	// Replicas are the running replicas by identity, for the sidecar's checks at the end.
	Replicas map[string]*Replica
	// Rounds counts the rounds run, settled or not.
	Rounds int
	// Converge is, per settled round, the time from the SIGKILL until Problems listed
	// nothing.
	Converge []time.Duration
	// LastKill is when the last SIGKILL was sent.
	LastKill time.Time
}

// Run starts the replicas, waits until they are ready and runs rounds rounds; it stops
// early once the test failed.
func (c *ChaosRounds) Run(rounds int) {
	t := c.S.T
	t.Helper()
	c.Replicas = map[string]*Replica{}
	for i := range ChaosReplicas {
		id := fmt.Sprintf("replica-%d", i)
		c.Replicas[id] = c.Start(id, id)
	}
	for _, r := range c.Replicas {
		r.WaitReady(t)
	}
	for round := range rounds {
		c.round(round)
		if t.Failed() {
			break
		}
	}
}

func (c *ChaosRounds) round(round int) {
	t := c.S.T
	t.Helper()
	c.S.WaitForRunningHolder(c.Lease, c.Replicas)
	c.Work(round)
	var id string
	c.S.WaitForCalls(fmt.Sprintf("round %d: the leader's calls running", round), func(calls []testdriver.Call) bool {
		for rid, r := range c.Replicas {
			if r.Running() && c.InFlight(round, calls, r) {
				id = rid
				return true
			}
		}
		return false
	})
	leader := c.Replicas[id]
	killed := leader.Signal(t, syscall.SIGKILL)
	c.LastKill = killed
	leader.Wait(t, 10*time.Second)
	if c.Leaderless != nil {
		c.Leaderless(round)
	}
	name, again := fmt.Sprintf("%s-restart-%02d", id, round), id
	if round%2 == 1 {
		again = fmt.Sprintf("replica-r%02d", round)
		name = again
	}
	delete(c.Replicas, id)
	c.Replicas[again] = c.Start(name, again)
	t.Logf("round %d: killed %s (identity %s), started %s (identity %s)", round, leader.Name, id, name, again)
	c.Rounds++
	if c.Problems != nil {
		c.settle(round, killed)
	}
	if c.Settled != nil {
		c.Settled(round, leader)
	}
}

// settle polls Problems: "settled" spans the API server and the driver, with no one event
// to wait on.
func (c *ChaosRounds) settle(round int, killed time.Time) {
	t := c.S.T
	t.Helper()
	timeout := c.SettleTimeout
	if timeout == 0 {
		timeout = defaultChaosSettle
	}
	var problems []string
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		problems = c.Problems()
		return len(problems) == 0, nil
	})
	if err != nil {
		t.Errorf("round %d: not settled %v after the kill: %v", round, timeout, problems)
		return
	}
	c.Converge = append(c.Converge, time.Since(killed))
}

// CallsFor are the calls of method on r whose key (a volume's ID or name, say) is in keys:
// a chaos round's calls for its own work.
func CallsFor(calls []testdriver.Call, r *Replica, method string, key func(testdriver.Call) string, keys map[string]bool) []testdriver.Call {
	var out []testdriver.Call
	for _, c := range CallsOn(calls, r, method) {
		if keys[key(c)] {
			out = append(out, c)
		}
	}
	return out
}

// Succeeded counts the calls that ended OK.
func Succeeded(calls []testdriver.Call) int {
	n := 0
	for _, c := range calls {
		if c.Code == "OK" {
			n++
		}
	}
	return n
}
