package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/connection"
	"github.com/kubernetes-csi/csi-lib-utils/metrics"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
)

// serverConn is the Servers' connection to the driver: dialled in the background until the
// driver listens, re-dialled by gRPC whenever it restarts (csi-lib-utils' default without
// OnConnectionLoss), each call counted and tied to its Server's Ops().
type serverConn struct {
	ready chan struct{} // closed once conn is set, or dialling gave up
	conn  *grpc.ClientConn
	err   error
	// record records a call once the process has CSI call metrics (nil: not yet).
	record func() metrics.CSIMetricsManager
}

// dialServerConn starts dialling address until ctx ends.
func dialServerConn(ctx context.Context, address string, record func() metrics.CSIMetricsManager) *serverConn {
	c := &serverConn{ready: make(chan struct{}), record: record}
	go func() {
		defer close(c.ready)
		// No deadline: a driver container that starts late is waited for, as upstream's
		// livenessprobe does; ctx ends it.
		c.conn, c.err = connection.Connect(ctx, address, nil, connection.WithTimeout(0))
		if c.err != nil {
			c.err = fmt.Errorf("connecting to the CSI driver at %s: %w", address, c.err)
		}
	}()
	return c
}

// wait returns the connection once dialled, or why there is none.
func (c *serverConn) wait(ctx context.Context) (*grpc.ClientConn, error) {
	select {
	case <-c.ready:
		return c.conn, c.err
	case <-ctx.Done():
		return nil, status.Errorf(codes.Unavailable, "the CSI driver at its socket does not answer yet: %v", ctx.Err())
	}
}

func (c *serverConn) close() {
	<-c.ready
	if c.conn != nil {
		c.conn.Close()
	}
}

// serverCalls is one Server's view of the serverConn.
type serverCalls struct {
	conn  *serverConn
	ops   context.Context
	calls callCount
}

var _ grpc.ClientConnInterface = &serverCalls{}

func (c *serverCalls) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	defer c.calls.begin()()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(c.ops, cancel)()
	conn, err := c.conn.wait(ctx)
	if err != nil {
		return err
	}
	invoke := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
		return cc.Invoke(ctx, method, req, reply, opts...)
	}
	if mm := c.conn.record(); mm != nil {
		return connection.ExtendedCSIMetricsManager{CSIMetricsManager: mm}.RecordMetricsClientInterceptor(ctx, method, args, reply, conn, invoke, opts...)
	}
	return invoke(ctx, method, args, reply, conn, opts...)
}

func (c *serverCalls) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	conn, err := c.conn.wait(ctx)
	if err != nil {
		return nil, err
	}
	return conn.NewStream(ctx, desc, method, opts...)
}

// driverNamer asks the driver its name once for all Servers of the process.
type driverNamer struct {
	conn   grpc.ClientConnInterface
	onName func(name string)

	mu   sync.Mutex
	name string
}

// get waits until the driver reports its name, retrying with backoff until ctx ends.
// Callers wait for the first one's answer, the lock held: one call in flight at a time.
func (n *driverNamer) get(ctx context.Context) (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.name != "" {
		return n.name, nil
	}
	backoff := wait.Backoff{Duration: 500 * time.Millisecond, Factor: 2, Jitter: 0.1, Steps: math.MaxInt32, Cap: 10 * time.Second}
	err := wait.ExponentialBackoffWithContext(ctx, backoff, func(ctx context.Context) (bool, error) {
		callCtx, cancel := context.WithTimeout(ctx, defaultProbeTimeout)
		defer cancel()
		rsp, err := csi.NewIdentityClient(n.conn).GetPluginInfo(callCtx, &csi.GetPluginInfoRequest{})
		if err == nil && rsp.GetName() == "" {
			err = errors.New("the driver reported an empty name")
		}
		if err != nil {
			klog.FromContext(ctx).Error(err, "The CSI driver did not tell its name (GetPluginInfo); retrying")
			return false, nil
		}
		n.name = rsp.GetName()
		return true, nil
	})
	if err != nil {
		return "", fmt.Errorf("waiting for the CSI driver's name (GetPluginInfo): %w", err)
	}
	n.onName(n.name)
	return n.name, nil
}

// servers are the process's hosted Servers while they run.
type servers struct {
	done  chan struct{}
	codes []int
}

// startServers starts every Server. Each serves until intake ends; one that ends on its
// own stops the process (the others drain too). wait returns the worst exit code.
func (p *process) startServers(ctx context.Context, hosted []Server, alone bool, diag *diagnostics, record func() metrics.CSIMetricsManager, onName func(string)) *servers {
	s := &servers{done: make(chan struct{}), codes: make([]int, len(hosted))}
	if len(hosted) == 0 {
		close(s.done)
		return s
	}
	// The connection lives until the last Server returned, through the drain.
	dialing, stopDialing := context.WithCancel(context.WithoutCancel(ctx))
	conn := dialServerConn(dialing, p.opts.CSIAddress, record)
	ops, cancelOps := context.WithCancel(context.WithoutCancel(ctx))
	names := &driverNamer{conn: &serverCalls{conn: conn, ops: ops}, onName: onName}
	var wg sync.WaitGroup
	for i, srv := range hosted {
		inflight := p.metrics.inflight.WithLabelValues(srv.Name())
		env := &ServerEnv{
			CSI:          &serverCalls{conn: conn, ops: ops, calls: callCount{onChange: func(d int64) { inflight.Add(float64(d)) }}},
			CSIAddress:   p.opts.CSIAddress,
			Alone:        alone,
			HTTPEndpoint: p.opts.HTTPEndpoint,
			ops:          ops,
			driverName:   names.get,
			diag:         diag,
		}
		wg.Go(func() {
			s.codes[i] = p.serve(ctx, srv, env)
			p.stop(ctx, "sidecar "+srv.Name()+" ended")
		})
	}
	go func() {
		wg.Wait()
		cancelOps()
		stopDialing()
		conn.close()
		close(s.done)
	}()
	// The drain deadline cancels what the Servers still do.
	go func() {
		select {
		case <-p.drainExpired.Done():
			cancelOps()
		case <-s.done:
		}
	}()
	return s
}

// serve runs one Server until it returns, and its exit code: 0 when it drained after
// intake ended, ExitError when it ended on its own or with an error, or when the drain
// deadline passed first (the process then exits without it).
func (p *process) serve(ctx context.Context, srv Server, env *ServerEnv) int {
	logger := klog.FromContext(ctx).WithValues("sidecar", srv.Name())
	ctx = klog.NewContext(ctx, logger)
	intake := klog.NewContext(p.intake, logger)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(intake, env) }()
	select {
	case err := <-done:
		switch {
		case errors.Is(err, ErrNothingToServe):
			logger.Info("Sidecar has nothing to serve")
			return ExitOK
		case p.intake.Err() == nil:
			if err == nil {
				err = errReturnedEarly
			}
			logger.Error(err, "Sidecar stopped on its own")
			return ExitError
		case err != nil:
			logger.Error(err, "Sidecar returned an error while draining")
			return ExitError
		}
		if elapsed, ok := p.drainTime(); ok {
			logger.Info("Drained: every call in flight ended", "drainDuration", elapsed.Round(time.Millisecond).String())
		}
		return ExitOK
	case <-p.drainExpired.Done():
		logger.Error(errors.New("drain deadline"), "Sidecar did not finish within --drain-timeout; exiting without it", "drainTimeout", p.opts.DrainTimeout)
		return ExitError
	}
}

// wait waits until every Server returned (serve returns at the drain deadline at the
// latest) and returns the worst exit code.
func (s *servers) wait() int {
	<-s.done
	code := ExitOK
	for _, c := range s.codes {
		code = max(code, c)
	}
	return code
}
