package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/connection"
	"github.com/kubernetes-csi/csi-lib-utils/metrics"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"
	csitrans "k8s.io/csi-translation-lib"
)

// defaultProbeTimeout bounds one Probe call when no hosted sidecar has a --timeout;
// ProbeForever repeats it until the driver is ready.
const defaultProbeTimeout = 10 * time.Second

// driver is what the core learned from the CSI driver at start-up.
type driver struct {
	conn *grpc.ClientConn
	// metrics records every call on conn (csi_sidecar_operations_seconds).
	metrics                metrics.CSIMetricsManager
	name                   string
	pluginCapabilities     rpc.PluginCapabilitySet
	controllerCapabilities rpc.ControllerCapabilitySet
}

// connectDriver connects to the driver socket (retrying until ctx ends), waits until it
// is ready and reads its name and capabilities. A driver that replaced an in-tree plugin
// gets upstream's "migrated" label on its call metrics: that needs the driver's name
// before the connection, so such a driver is connected to a second time, as upstream does.
// onLoss is called once if the connection is lost later, until lifetime ends (through the
// drain: a driver that dies while calls drain must keep the Lease); the connection is then
// not re-established, as upstream does, so the process shuts down instead of talking to a
// restarted driver that forgot its in-flight work.
func connectDriver(ctx, lifetime context.Context, address string, probeTimeout time.Duration, onLoss func()) (*driver, error) {
	var lost atomic.Bool
	loss := func() {
		if lost.CompareAndSwap(false, true) {
			onLoss()
		}
	}
	d := &driver{metrics: metrics.NewCSIMetricsManagerWithOptions("")}
	conn, err := dialAndProbe(ctx, address, probeTimeout, d.metrics, loss)
	if err != nil {
		return nil, err
	}
	if d.name, err = rpc.GetDriverName(ctx, conn); err != nil {
		conn.Close()
		return nil, fmt.Errorf("getting CSI driver name: %w", err)
	}
	if csitrans.New().IsMigratedCSIDriverByName(d.name) {
		conn.Close()
		d.metrics = metrics.NewCSIMetricsManagerWithOptions(d.name, metrics.WithMigration())
		if conn, err = dialAndProbe(ctx, address, probeTimeout, d.metrics, loss); err != nil {
			return nil, err
		}
	} else {
		d.metrics.SetDriverName(d.name)
	}
	d.conn = conn
	if d.pluginCapabilities, err = rpc.GetPluginCapabilities(ctx, conn); err != nil {
		conn.Close()
		return nil, fmt.Errorf("getting CSI plugin capabilities: %w", err)
	}
	// gRPC only redials when a call is made, so an idle sidecar would not notice a driver
	// that went away; watching the channel's state does.
	go watchConnection(lifetime, conn, loss)
	d.controllerCapabilities = rpc.ControllerCapabilitySet{}
	if d.pluginCapabilities[csi.PluginCapability_Service_CONTROLLER_SERVICE] {
		if d.controllerCapabilities, err = rpc.GetControllerCapabilities(ctx, conn); err != nil {
			conn.Close()
			return nil, fmt.Errorf("getting CSI controller capabilities: %w", err)
		}
	}
	return d, nil
}

// dialAndProbe connects to the driver with its calls recorded in mm and waits until the
// driver answers Probe as ready.
func dialAndProbe(ctx context.Context, address string, probeTimeout time.Duration, mm metrics.CSIMetricsManager, onLoss func()) (*grpc.ClientConn, error) {
	conn, err := connection.Connect(ctx, address, mm, connection.OnConnectionLoss(func(context.Context) bool {
		onLoss()
		return false
	}))
	if err != nil {
		return nil, fmt.Errorf("connecting to CSI driver at %s: %w", address, err)
	}
	if err := rpc.ProbeForever(ctx, conn, probeTimeout); err != nil {
		conn.Close()
		return nil, fmt.Errorf("probing CSI driver at %s: %w", address, err)
	}
	return conn, nil
}

// watchConnection calls onLoss when a ready connection stops being ready.
func watchConnection(ctx context.Context, conn *grpc.ClientConn, onLoss func()) {
	for {
		state := conn.GetState()
		if state != connectivity.Ready {
			onLoss()
			return
		}
		if !conn.WaitForStateChange(ctx, state) {
			return
		}
	}
}

// IsFinalError tells whether a failed CSI call is certainly not running in the driver any
// more. A call that was cut off (cancelled, timed out, connection broken), that the driver
// still works on (Aborted) or that ran out of resources for now (ResourceExhausted) may
// still run or succeed on retry: such calls are retried with the same arguments and not
// reported as final. An error that is no gRPC status is not final either: nothing says the
// call was not sent.
func IsFinalError(err error) bool {
	st, ok := status.FromError(err)
	if !ok {
		return false
	}
	switch st.Code() {
	case codes.Canceled, codes.DeadlineExceeded, codes.Unavailable, codes.ResourceExhausted, codes.Aborted:
		return false
	}
	return true
}

// fencedConn is one sidecar's view of the shared driver connection. It counts calls in
// flight and ties each call to the sidecar's Ops() context, so losing the Lease or running
// out of drain time cancels every CSI call at once, however the caller built its context
// (P3, P6). After fencing, and from the first signal on, it refuses new calls: a drain
// waits only for the calls already in the driver and the writes that record them (P14);
// work that had not reached the driver is left, with what it recorded, to the next leader.
type fencedConn struct {
	conn  grpc.ClientConnInterface
	ops   context.Context
	calls callCount
	// draining is set when intake ends.
	draining atomic.Bool
	// broken is set when a call ended with Unavailable: the connection may have broken under
	// it, and the driver may still be working on it.
	broken atomic.Bool
}

var _ grpc.ClientConnInterface = &fencedConn{}

func (c *fencedConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	// Counted before the check: once draining is set, a count of zero means no call can
	// still reach the driver (idleAfterDrain).
	defer c.calls.begin()()
	if c.ops.Err() != nil {
		return notStarted(method, "this replica stopped leading or ran out of drain time")
	}
	if c.draining.Load() {
		return notStarted(method, "this replica is shutting down; the next leader does it")
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(c.ops, cancel)
	defer stop()

	err := c.conn.Invoke(ctx, method, args, reply, opts...)
	if status.Code(err) == codes.Unavailable {
		c.broken.Store(true)
	}
	return err
}

func (c *fencedConn) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	// CSI has no streaming calls; pass through, still bound to Ops().
	if c.ops.Err() != nil {
		return nil, notStarted(method, "this replica stopped leading")
	}
	return c.conn.NewStream(ctx, desc, method, opts...)
}

// notStartedError is a CSI call the core refused to send: Aborted to whoever reads its
// gRPC code (the operation is retried, as after any Aborted), and NotStarted to a sidecar
// that must not report it as the driver's failure.
type notStartedError struct {
	st *status.Status
	// err is the error of a starting write intake's end cut short (IfNotStarted).
	err error
}

func notStarted(method, why string) error {
	return notStartedError{st: status.Newf(codes.Aborted, "%s not started: %s", method, why)}
}

func (e notStartedError) Error() string              { return e.st.Err().Error() }
func (e notStartedError) GRPCStatus() *status.Status { return e.st }
func (e notStartedError) Unwrap() error              { return e.err }

// NotStarted tells whether err is a CSI call that never reached the driver because this
// replica is draining or no longer leads, or a write that would start work and that
// intake's end cut short (IfNotStarted). Such a call failed nothing: a sidecar records no
// event or status for it and leaves the operation, as it stands, to the next leader.
func NotStarted(err error) bool {
	var e notStartedError
	return errors.As(err, &e)
}

// InFlight is the number of CSI calls running now.
func (c *fencedConn) InFlight() int64 { return c.calls.inFlight() }

// drain refuses every call from now on.
func (c *fencedConn) drain() { c.draining.Store(true) }

// idleAfterDrain tells, once drain was called, whether nothing of this replica can still be
// running in the driver: no call in flight, none can start, and none was cut off by a
// broken connection.
func (c *fencedConn) idleAfterDrain() bool {
	return c.draining.Load() && c.calls.inFlight() == 0 && !c.broken.Load()
}

// MarkMigrated labels the metrics of the CSI calls made on the returned context as those of
// a migrated in-tree volume (migrated="true") or not, as upstream's sidecars do.
func MarkMigrated(ctx context.Context, migrated bool) context.Context {
	return context.WithValue(ctx, connection.AdditionalInfoKey, connection.AdditionalInfo{Migrated: strconv.FormatBool(migrated)})
}
