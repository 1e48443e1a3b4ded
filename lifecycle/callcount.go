package lifecycle

import "sync/atomic"

// callCount counts a connection's CSI calls in flight and tells onChange (the
// inflight_operations gauge) of each change.
type callCount struct {
	n        atomic.Int64
	onChange func(delta int64) // nil: nobody is told
}

// begin counts a call in; the function it returns counts it out.
func (c *callCount) begin() (end func()) {
	c.add(1)
	return func() { c.add(-1) }
}

// inFlight is the number of calls counted in and not yet out.
func (c *callCount) inFlight() int64 { return c.n.Load() }

func (c *callCount) add(delta int64) {
	c.n.Add(delta)
	if c.onChange != nil {
		c.onChange(delta)
	}
}
