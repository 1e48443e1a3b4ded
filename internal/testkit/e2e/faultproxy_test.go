package e2e

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// quiet is how long a negative check waits for a byte that must not come: long enough for
// loopback traffic to arrive many times over, short enough to keep the tests fast.
const quiet = 300 * time.Millisecond

// upstream is an echo server standing for the apiserver: it records what each connection
// received and whether it was closed, and lets the test write on its own.
type upstream struct {
	ln net.Listener
	wg sync.WaitGroup

	mu       sync.Mutex
	conns    []net.Conn
	received bytes.Buffer
	closed   int
}

func newUpstream(t *testing.T) *upstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("echo server: listening: %v", err)
	}
	u := &upstream{ln: ln}
	u.wg.Add(1)
	go func() {
		defer u.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u.mu.Lock()
			u.conns = append(u.conns, c)
			u.mu.Unlock()
			u.wg.Add(1)
			go u.echo(c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		u.mu.Lock()
		for _, c := range u.conns {
			c.Close()
		}
		u.mu.Unlock()
		u.wg.Wait()
	})
	return u
}

func (u *upstream) echo(c net.Conn) {
	defer u.wg.Done()
	defer c.Close()
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			u.mu.Lock()
			u.received.Write(buf[:n])
			u.mu.Unlock()
			if _, err := c.Write(buf[:n]); err != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	u.mu.Lock()
	u.closed++
	u.mu.Unlock()
}

// state is what the server saw so far: connections accepted, bytes received, connections
// that ended.
func (u *upstream) state() (accepted int, received string, closed int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.conns), u.received.String(), u.closed
}

// conn is the i-th connection the server accepted.
func (u *upstream) conn(i int) net.Conn {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.conns[i]
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("dialling the proxy: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func write(t *testing.T, c net.Conn, s string) {
	t.Helper()
	if _, err := c.Write([]byte(s)); err != nil {
		t.Fatalf("writing %q: %v", s, err)
	}
}

// expect reads exactly want from c, waiting for it up to 10 s.
func expect(t *testing.T, c net.Conn, want string) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatalf("reading %q: got %q: %v", want, got, err)
	}
	if string(got) != want {
		t.Fatalf("read %q, want %q", got, want)
	}
}

// expectNothing checks that nothing arrives on c for a while.
func expectNothing(t *testing.T, c net.Conn) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(quiet))
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read %q (%v) through a frozen proxy, want nothing", buf[:n], err)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return cond(), nil
	})
	if err != nil {
		t.Fatalf("waiting until %s: %v", what, err)
	}
}

func TestFaultProxyForwards(t *testing.T) {
	u := newUpstream(t)
	p := NewFaultProxy(t, u.ln.Addr().String())
	if p.URL() != "https://"+p.Addr() {
		t.Errorf("URL() = %q, Addr() = %q", p.URL(), p.Addr())
	}
	c := dial(t, p.Addr())
	write(t, c, "hello")
	expect(t, c, "hello")
	if _, got, _ := u.state(); got != "hello" {
		t.Errorf("server received %q, want %q", got, "hello")
	}
}

func TestFaultProxyFreezeHoldsOpenConnection(t *testing.T) {
	u := newUpstream(t)
	p := NewFaultProxy(t, u.ln.Addr().String())
	c := dial(t, p.Addr())
	write(t, c, "one")
	expect(t, c, "one")

	p.Freeze()
	if !p.Frozen() {
		t.Fatal("Frozen() = false after Freeze")
	}
	// Client to server.
	write(t, c, "two")
	expectNothing(t, c)
	if _, got, _ := u.state(); got != "one" {
		t.Fatalf("server received %q through a frozen proxy, want only %q", got, "one")
	}
	// Server to client.
	if _, err := u.conn(0).Write([]byte("push")); err != nil {
		t.Fatal(err)
	}
	expectNothing(t, c)

	p.Thaw()
	if p.Frozen() {
		t.Fatal("Frozen() = true after Thaw")
	}
	// Held bytes come in order: the push was held before the echo of "two" was sent.
	expect(t, c, "pushtwo")
	if _, got, _ := u.state(); got != "onetwo" {
		t.Errorf("server received %q, want %q", got, "onetwo")
	}
	if _, _, closed := u.state(); closed != 0 {
		t.Errorf("%d connections closed by freezing", closed)
	}
}

func TestFaultProxyFreezeHoldsNewConnection(t *testing.T) {
	u := newUpstream(t)
	p := NewFaultProxy(t, u.ln.Addr().String())
	p.Freeze()
	c := dial(t, p.Addr())
	write(t, c, "early")
	expectNothing(t, c)
	if accepted, got, _ := u.state(); accepted != 0 || got != "" {
		t.Fatalf("server accepted %d connections and received %q through a frozen proxy", accepted, got)
	}
	p.Thaw()
	expect(t, c, "early")
}

func TestFaultProxyClosesUpstream(t *testing.T) {
	u := newUpstream(t)
	p := NewFaultProxy(t, u.ln.Addr().String())
	c := dial(t, p.Addr())
	write(t, c, "bye")
	expect(t, c, "bye")
	c.Close()
	waitFor(t, "the server's connection is closed", func() bool {
		_, _, closed := u.state()
		return closed == 1
	})
}

func TestFaultProxyCloseWhileFrozenWaitsForThaw(t *testing.T) {
	u := newUpstream(t)
	p := NewFaultProxy(t, u.ln.Addr().String())
	c := dial(t, p.Addr())
	write(t, c, "x")
	expect(t, c, "x")
	p.Freeze()
	write(t, c, "last")
	c.Close()
	// The close is traffic too: hold it. A negative check, so a short wait.
	time.Sleep(quiet)
	if _, got, closed := u.state(); got != "x" || closed != 0 {
		t.Fatalf("server received %q and saw %d closes through a frozen proxy", got, closed)
	}
	p.Thaw()
	waitFor(t, "the held bytes, then the close, reach the server", func() bool {
		_, got, closed := u.state()
		return got == "xlast" && closed == 1
	})
}

// TestFaultProxyFreezeUnderTraffic freezes and thaws while data streams both ways, and
// checks that every byte arrives once, in order.
func TestFaultProxyFreezeUnderTraffic(t *testing.T) {
	u := newUpstream(t)
	p := NewFaultProxy(t, u.ln.Addr().String())
	c := dial(t, p.Addr())

	data := make([]byte, 1<<20)
	for i := range data {
		data[i] = byte(i * 7 % 251)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				p.Thaw()
				return
			case <-time.After(time.Millisecond):
			}
			if p.Frozen() {
				p.Thaw()
			} else {
				p.Freeze()
			}
		}
	}()
	writeErr := make(chan error, 1)
	go func() {
		defer wg.Done()
		for rest := data; len(rest) > 0; rest = rest[min(len(rest), 1000):] {
			if _, err := c.Write(rest[:min(len(rest), 1000)]); err != nil {
				writeErr <- err
				return
			}
		}
		writeErr <- nil
	}()
	got := make([]byte, len(data))
	_ = c.SetReadDeadline(time.Now().Add(60 * time.Second))
	_, err := io.ReadFull(c, got)
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("reading the echo: %v", err)
	}
	if err := <-writeErr; err != nil {
		t.Fatalf("writing: %v", err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("the echo differs from what was sent")
	}
}

// TestFaultProxyCleanup checks that the end of the test closes a frozen proxy's
// connections rather than hanging on them.
func TestFaultProxyCleanup(t *testing.T) {
	u := newUpstream(t)
	t.Run("frozen", func(t *testing.T) {
		p := NewFaultProxy(t, u.ln.Addr().String())
		c := dial(t, p.Addr())
		write(t, c, "x")
		expect(t, c, "x")
		p.Freeze()
		write(t, c, "held")
	})
	// The subtest's end closed the proxy; the server's side must follow.
	waitFor(t, "the server's connection is closed", func() bool {
		_, _, closed := u.state()
		return closed == 1
	})
	if _, got, _ := u.state(); got != "x" {
		t.Errorf("server received %q, want %q: held bytes leaked on close", got, "x")
	}
}
