package testdriver_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/logtest"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func TestOperationContinuesAfterCancel(t *testing.T) {
	// Long enough that the deadline (a quarter of it) leaves a loaded machine time to send
	// the call, and the operation still runs well past the caller's return.
	const latency = time.Second
	for _, tc := range []struct {
		name     string
		start    func(context.Context) (context.Context, context.CancelFunc)
		cancel   bool // cancel once the call runs, instead of waiting for a deadline
		wantCode codes.Code
	}{
		{"cancel", context.WithCancel, true, codes.Canceled},
		{"deadline", func(ctx context.Context) (context.Context, context.CancelFunc) {
			return context.WithTimeout(ctx, latency/4)
		}, false, codes.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			d := startDriver(t, testdriver.Config{Latency: fastLatency}, 1)
			c := d.ctrl(0)
			id := mustCreate(ctx, t, c, "pvc-1")
			d.b.SetMethodLatency(testdriver.MethodControllerPublishVolume, latency)

			callCtx, cancel := tc.start(ctx)
			defer cancel()
			errc := make(chan error, 1)
			go func() {
				_, err := c.ControllerPublishVolume(callCtx, publishReq(id, "node-a", false))
				errc <- err
			}()
			if err := d.b.WaitFor(ctx, startedCalls(testdriver.MethodControllerPublishVolume, 1)); err != nil {
				t.Fatal(err)
			}
			if tc.cancel {
				cancel()
			}
			err := <-errc
			returned := time.Now()
			wantCode(t, "publish", err, tc.wantCode)

			if err := d.b.WaitFor(ctx, doneCalls(testdriver.MethodControllerPublishVolume, 1)); err != nil {
				t.Fatal(err)
			}
			call := callsOf(d.b.Journal(), testdriver.MethodControllerPublishVolume)[0]
			if !call.Canceled || call.Code != "OK" {
				t.Errorf("journal entry %+v, want a canceled call whose operation succeeded", call)
			}
			if !call.End.After(returned) || call.End.Sub(call.Start) < latency {
				t.Errorf("operation ended %v after start and %v after the handler returned; want it to run its full %v after the caller left",
					call.End.Sub(call.Start), call.End.Sub(returned), latency)
			}
			if v, _ := d.b.Volume(id); len(v.Published) != 1 {
				t.Errorf("volume after the abandoned publish: %+v, want it published", v)
			}
		})
	}
}

// A held call stays running until the test releases it, whatever the time; calls that
// start after the release are not held.
func TestHeldCallsRunUntilReleased(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{}, 1)
	c := d.ctrl(0)
	id := mustCreate(ctx, t, c, "pvc-1")
	release := d.b.Hold(testdriver.MethodControllerPublishVolume)
	errc := make(chan error, 1)
	go func() {
		_, err := c.ControllerPublishVolume(ctx, publishReq(id, "node-a", false))
		errc <- err
	}()
	if err := d.b.WaitFor(ctx, startedCalls(testdriver.MethodControllerPublishVolume, 1)); err != nil {
		t.Fatal(err)
	}
	// Other methods are not held.
	if _, err := c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-b"}); err != nil {
		t.Fatalf("unpublish while publish is held: %v", err)
	}
	select {
	case err := <-errc:
		t.Fatalf("held publish returned %v before its release", err)
	default:
	}
	if v, _ := d.b.Volume(id); len(v.Published) != 0 {
		t.Errorf("volume while its publish is held: %+v, want it not published yet", v)
	}
	release()
	if err := <-errc; err != nil {
		t.Fatalf("released publish: %v", err)
	}
	if v, _ := d.b.Volume(id); len(v.Published) != 1 {
		t.Errorf("volume after the release: %+v, want it published", v)
	}
	// After the release, calls are not held.
	if _, err := c.ControllerPublishVolume(ctx, publishReq(id, "node-a", false)); err != nil {
		t.Fatalf("publish after the release: %v", err)
	}
	release() // a second release is harmless
}

func TestLatencyChangesAtRunTime(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{}, 1)
	c := d.ctrl(0)
	timed := func() time.Duration {
		start := time.Now()
		if _, err := c.GetCapacity(ctx, &csi.GetCapacityRequest{}); err != nil {
			t.Fatalf("GetCapacity: %v", err)
		}
		return time.Since(start)
	}
	// Generous, so that a loaded machine cannot make a fast call look slow.
	const slow = time.Second
	d.b.SetLatency(slow)
	if got := timed(); got < slow {
		t.Errorf("GetCapacity took %v with a %v default latency", got, slow)
	}
	d.b.SetMethodLatency(testdriver.MethodGetCapacity, 0)
	if got := timed(); got >= slow {
		t.Errorf("GetCapacity took %v with a 0 override", got)
	}
	d.b.ClearMethodLatency(testdriver.MethodGetCapacity)
	if got := timed(); got < slow {
		t.Errorf("GetCapacity took %v after clearing the override", got)
	}
	// Identity calls are not slowed by the default latency.
	start := time.Now()
	if _, err := d.ident(0).Probe(ctx, &csi.ProbeRequest{}); err != nil || time.Since(start) >= slow {
		t.Errorf("Probe took %v (err %v) with only a default latency", time.Since(start), err)
	}
}

func TestJournal(t *testing.T) {
	ctx := testCtx(t)
	var buf logtest.Buffer
	d := startDriver(t, testdriver.Config{Latency: fastLatency, JournalWriter: &buf}, 2)

	id := mustCreate(ctx, t, d.ctrl(0), "pvc-1")
	if _, err := d.ctrl(1).ControllerPublishVolume(ctx, publishReq(id, "node-a", false)); err != nil {
		t.Fatalf("publish: %v", err)
	}
	_, err := d.ctrl(1).ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "vol-00000042", CapacityRange: &csi.CapacityRange{RequiredBytes: 1}})
	wantCode(t, "expand unknown", err, codes.NotFound)

	calls := d.b.Journal()
	if len(calls) != 3 {
		t.Fatalf("journal has %d calls, want 3: %+v", len(calls), calls)
	}
	want := []testdriver.Call{
		{Seq: 0, Socket: d.servers[0].Socket(), Method: testdriver.MethodCreateVolume, VolumeID: id, VolumeName: "pvc-1", Code: "OK"},
		{Seq: 1, Socket: d.servers[1].Socket(), Method: testdriver.MethodControllerPublishVolume, VolumeID: id, NodeID: "node-a", Code: "OK"},
		{Seq: 2, Socket: d.servers[1].Socket(), Method: testdriver.MethodControllerExpandVolume, VolumeID: "vol-00000042", Code: "NotFound"},
	}
	for i, c := range calls {
		if c.Start.IsZero() || c.End.Sub(c.Start) < fastLatency {
			t.Errorf("call %d lasted %v from %v, want at least the latency %v", i, c.End.Sub(c.Start), c.Start, fastLatency)
		}
		if c.Canceled {
			t.Errorf("call %d marked canceled", i)
		}
		// The test's context has a deadline of 20 s; the journal records what is left of it.
		if c.Deadline <= 0 || c.Deadline > 20*time.Second {
			t.Errorf("call %d came with %v to its deadline, want some of the caller's 20 s", i, c.Deadline)
		}
		c.Start, c.End, c.Message, c.Deadline = time.Time{}, time.Time{}, "", 0
		if c != want[i] {
			t.Errorf("call %d = %+v, want %+v", i, c, want[i])
		}
	}

	// The JSON lines hold the same calls, each written when it ended.
	var lines []testdriver.Call
	sc := bufio.NewScanner(bytes.NewReader(buf.Bytes()))
	for sc.Scan() {
		var c testdriver.Call
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			t.Fatalf("journal line %q: %v", sc.Text(), err)
		}
		lines = append(lines, c)
	}
	if len(lines) != len(calls) {
		t.Fatalf("%d journal lines, want %d", len(lines), len(calls))
	}
	for i := range lines {
		if !lines[i].End.Equal(calls[i].End) || lines[i].Method != calls[i].Method || lines[i].Code != calls[i].Code {
			t.Errorf("journal line %d = %+v, want %+v", i, lines[i], calls[i])
		}
	}
}

func TestWaitForHonoursContext(t *testing.T) {
	d := startDriver(t, testdriver.Config{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := d.b.WaitFor(ctx, func([]testdriver.Call) bool { return false })
	if !errors.Is(err, context.Canceled) {
		t.Errorf("WaitFor on a cancelled context: %v", err)
	}
}

func TestOverlaps(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency}, 2)
	id := mustCreate(ctx, t, d.ctrl(0), "pvc-1")
	// Sequential calls, even on different sockets, never overlap.
	if _, err := d.ctrl(0).ControllerPublishVolume(ctx, publishReq(id, "node-a", false)); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ctrl(1).ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"}); err != nil {
		t.Fatal(err)
	}
	if o := d.b.Overlaps(); len(o) != 0 {
		t.Fatalf("overlaps of sequential calls: %+v", o)
	}

	// A publish whose caller gave up still runs; an unpublish started
	// meanwhile on another socket overlaps it.
	// The unpublish must start within this time after the cancel; it is
	// generous so that a loaded machine still overlaps.
	d.b.SetMethodLatency(testdriver.MethodControllerPublishVolume, time.Second)
	pubCtx, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() {
		_, err := d.ctrl(0).ControllerPublishVolume(pubCtx, publishReq(id, "node-a", false))
		errc <- err
	}()
	if err := d.b.WaitFor(ctx, startedCalls(testdriver.MethodControllerPublishVolume, 2)); err != nil {
		t.Fatal(err)
	}
	cancel()
	wantCode(t, "abandoned publish", <-errc, codes.Canceled)
	if _, err := d.ctrl(1).ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-a"}); err != nil {
		t.Fatal(err)
	}
	if err := d.b.WaitFor(ctx, doneCalls(testdriver.MethodControllerPublishVolume, 2)); err != nil {
		t.Fatal(err)
	}

	overlaps := d.b.Overlaps()
	if len(overlaps) != 1 {
		t.Fatalf("overlaps: %+v, want 1", overlaps)
	}
	o := overlaps[0]
	if o.Volume != id || o.First.Method != testdriver.MethodControllerPublishVolume || !o.First.Canceled ||
		o.Second.Method != testdriver.MethodControllerUnpublishVolume || o.Second.Socket != d.servers[1].Socket() {
		t.Errorf("overlap %+v", o)
	}
	if !o.First.Done() || !o.Second.Done() {
		t.Errorf("overlap reports running calls after both ended: %+v", o)
	}
	// The abandoned publish ended last, so the volume is published again:
	// exactly the kind of bug the detector is there to explain.
	if v, _ := d.b.Volume(id); len(v.Published) != 1 {
		t.Errorf("volume %+v, want published by the abandoned call", v)
	}
}

func TestCreateOverlapsByName(t *testing.T) {
	ctx := testCtx(t)
	// The second create, on a connection not used yet, must start while the first runs.
	d := startDriver(t, testdriver.Config{Latency: time.Second}, 2)
	var wg sync.WaitGroup
	ids := make([]string, 2)
	for i := range 2 {
		wg.Go(func() { ids[i] = mustCreate(ctx, t, d.ctrl(i), "pvc-1") })
		// Start the second create only once the first runs, so that the
		// overlap always has the same order.
		if err := d.b.WaitFor(ctx, startedCalls(testdriver.MethodCreateVolume, i+1)); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	if ids[0] != ids[1] {
		t.Errorf("concurrent creates of one name gave %v", ids)
	}
	o := d.b.Overlaps()
	if len(o) != 1 || o[0].Volume != "name:pvc-1" || o[0].First.Seq != 0 || o[0].Second.Seq != 1 {
		t.Errorf("overlaps %+v, want the two creates of pvc-1", o)
	}
}

func TestInjectedFaults(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{Latency: fastLatency}, 1)
	c := d.ctrl(0)
	x, y := mustCreate(ctx, t, c, "pvc-x"), mustCreate(ctx, t, c, "pvc-y")
	publish := func(id string) error {
		_, err := c.ControllerPublishVolume(ctx, publishReq(id, "node-a", false))
		return err
	}

	if err := d.b.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerPublishVolume, Volume: x, Code: codes.Internal, Times: 2}); err != nil {
		t.Fatal(err)
	}
	wantCode(t, "publish y, not matched", publish(y), codes.OK)
	wantCode(t, "publish x #1", publish(x), codes.Internal)
	wantCode(t, "publish x #2", publish(x), codes.Internal)
	if v, _ := d.b.Volume(x); len(v.Published) != 0 {
		t.Errorf("a failed publish changed the volume: %+v", v)
	}
	wantCode(t, "publish x #3, fault used up", publish(x), codes.OK)

	// A fault without Times stays until cleared.
	if err := d.b.InjectFault(testdriver.Fault{Method: testdriver.MethodDeleteVolume, Code: codes.Unavailable, Message: "backend down"}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		_, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "vol-00000077"})
		wantCode(t, "delete with a permanent fault", err, codes.Unavailable)
		if i == 0 && err != nil && !bytes.Contains([]byte(err.Error()), []byte("backend down")) {
			t.Errorf("fault message lost: %v", err)
		}
	}
	d.b.ClearFaults()
	_, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "vol-00000077"})
	wantCode(t, "delete after ClearFaults", err, codes.OK)

	// ApplyAnyway: the backend acts but the answer is an error.
	if err := d.b.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerUnpublishVolume, Node: "node-a", Code: codes.DeadlineExceeded, Times: 1, ApplyAnyway: true}); err != nil {
		t.Fatal(err)
	}
	_, err = c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: x, NodeId: "node-a"})
	wantCode(t, "unpublish with a lost answer", err, codes.DeadlineExceeded)
	if v, _ := d.b.Volume(x); len(v.Published) != 0 {
		t.Errorf("ApplyAnyway fault did not apply the unpublish: %+v", v)
	}

	if err := d.b.InjectFault(testdriver.Fault{Method: testdriver.MethodProbe}); err == nil {
		t.Error("InjectFault accepted a fault with code OK")
	}
}

func TestStopMakesSocketUnreachable(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{}, 1)
	if _, err := d.ident(0).Probe(ctx, &csi.ProbeRequest{}); err != nil {
		t.Fatalf("Probe: %v", err)
	}
	srv := d.servers[0]
	srv.Stop()
	srv.Stop() // idempotent
	if _, err := os.Stat(srv.Socket()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket file after Stop: %v", err)
	}
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if _, err := d.ident(0).Probe(short, &csi.ProbeRequest{}); err == nil {
		t.Error("Probe succeeded after Stop")
	}

	// A new server may take over the path, even over a stale file.
	if err := os.WriteFile(srv.Socket(), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	again, err := d.b.Serve(srv.Socket())
	if err != nil {
		t.Fatalf("Serve over a stale file: %v", err)
	}
	defer again.Stop()
	if _, err := d.ident(0).Probe(ctx, &csi.ProbeRequest{}, waitForReady()); err != nil {
		t.Errorf("Probe after restart: %v", err)
	}
}

// SetProbeReady makes Probe answer ready=false, as a driver whose backend is not reachable,
// and true again; a call still answers OK either way.
func TestSetProbeReady(t *testing.T) {
	ctx := testCtx(t)
	d := startDriver(t, testdriver.Config{}, 1)
	ready := func() bool {
		t.Helper()
		rsp, err := d.ident(0).Probe(ctx, &csi.ProbeRequest{})
		if err != nil {
			t.Fatalf("Probe: %v", err)
		}
		if rsp.GetReady() == nil {
			t.Fatal("Probe answered without ready")
		}
		return rsp.GetReady().GetValue()
	}
	if !ready() {
		t.Error("a new driver is not ready")
	}
	d.b.SetProbeReady(false)
	if ready() {
		t.Error("ready after SetProbeReady(false)")
	}
	d.b.SetProbeReady(true)
	if !ready() {
		t.Error("not ready after SetProbeReady(true)")
	}
}
