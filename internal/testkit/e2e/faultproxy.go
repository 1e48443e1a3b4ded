package e2e

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"
)

// FaultProxy is a TCP proxy that a test puts between one replica and the apiserver to
// cut that replica off without closing anything. A frozen proxy keeps every connection
// open but moves no byte: this is what a network partition or a hung apiserver looks like
// to a client, which only notices through its own timeouts, unlike a refused or reset
// connection, which it notices at once. It works at L4, so TLS passes through untouched and
// the client still verifies the apiserver's certificate.
//
// Half-closes are not kept: when one side closes (or fails), the proxy closes the other
// once what it holds for it is forwarded. Clients of the apiserver never half-close.
type FaultProxy struct {
	t      testing.TB
	target string
	ln     net.Listener
	// ctx is cancelled on close, to abort dials to the target.
	ctx    context.Context
	cancel context.CancelFunc
	// wg counts the accept loop and every connection's goroutine, so that close returns
	// only when none is left.
	wg sync.WaitGroup

	mu sync.Mutex
	// cond is broadcast when frozen becomes false or closed becomes true: the two things a
	// held direction waits for.
	cond   *sync.Cond
	frozen bool
	closed bool
	// conns are the open connections, both the accepted and the dialled ones, closed with
	// the proxy.
	conns map[net.Conn]struct{}
}

// NewFaultProxy listens on 127.0.0.1 and forwards each connection it accepts to target
// ("127.0.0.1:port"), byte for byte in both directions. It is closed when t ends: the
// listener and every connection are closed and its goroutines have ended.
func NewFaultProxy(t testing.TB, target string) *FaultProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("fault proxy to %s: listening: %v", target, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &FaultProxy{t: t, target: target, ln: ln, ctx: ctx, cancel: cancel, conns: map[net.Conn]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// Addr is where the proxy listens, "127.0.0.1:port".
func (p *FaultProxy) Addr() string { return p.ln.Addr().String() }

// URL is the proxy as an apiserver URL, "https://127.0.0.1:port".
func (p *FaultProxy) URL() string { return "https://" + p.Addr() }

// Freeze stops all traffic: from now on no byte moves in either direction, on the
// connections already open and on those accepted later (which are not even forwarded to
// the target until Thaw). Connections stay open and what arrives is held, not dropped. A
// write to the other side that was already under way when Freeze was called still
// completes.
func (p *FaultProxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.frozen = true
}

// Thaw forwards, in order, what was held since Freeze and lets traffic flow again.
func (p *FaultProxy) Thaw() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.frozen = false
	p.cond.Broadcast()
}

// Frozen tells whether the proxy is frozen.
func (p *FaultProxy) Frozen() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.frozen
}

func (p *FaultProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				p.t.Logf("fault proxy to %s: accepting: %v", p.target, err)
			}
			return
		}
		if !p.track(c) {
			c.Close()
			return
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

// serve forwards one accepted connection until either side closes.
func (p *FaultProxy) serve(client net.Conn) {
	defer p.wg.Done()
	defer p.forget(client)
	// Even the connection must not reach the target while frozen: its bytes wait in the
	// kernel until Thaw.
	if !p.waitThawed() {
		return
	}
	dialer := net.Dialer{Timeout: 10 * time.Second}
	upstream, err := dialer.DialContext(p.ctx, "tcp", p.target)
	if err != nil {
		if p.ctx.Err() == nil {
			p.t.Logf("fault proxy: connecting to %s: %v", p.target, err)
		}
		return
	}
	if !p.track(upstream) {
		upstream.Close()
		return
	}
	defer p.forget(upstream)

	// Whichever direction ends first closes both connections, which ends the other one.
	var once sync.Once
	closeBoth := func() {
		once.Do(func() {
			client.Close()
			upstream.Close()
		})
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.pipe(client, upstream)
		closeBoth()
	}()
	p.pipe(upstream, client)
	closeBoth()
	<-done
}

// pipe copies src to dst until src ends, holding each chunk read while the proxy is
// frozen. Reading on while frozen is harmless: only one buffer is read ahead, and nothing
// reaches dst before Thaw. When src ends, dst is half-closed, so that what was written to
// it goes out before the FIN (the caller then closes both), once thawed too, as the close
// is traffic as well.
func (p *FaultProxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if !p.waitThawed() {
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if tc, ok := dst.(*net.TCPConn); ok {
				_ = tc.CloseWrite()
			}
			return
		}
	}
}

// waitThawed waits while the proxy is frozen and tells whether it is still open.
func (p *FaultProxy) waitThawed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.frozen && !p.closed {
		p.cond.Wait()
	}
	return !p.closed
}

// track records c to be closed with the proxy, unless the proxy is already closed.
func (p *FaultProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

// forget closes c and drops it from the open connections.
func (p *FaultProxy) forget(c net.Conn) {
	c.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.conns, c)
}

// close ends everything: held directions give up, dials are aborted, the listener and
// every connection are closed, which unblocks every read and write. It returns once all
// goroutines have ended.
func (p *FaultProxy) close() {
	p.mu.Lock()
	p.closed = true
	p.cond.Broadcast()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.cancel()
	p.ln.Close()
	p.wg.Wait()
}

// KubeconfigVia writes into s.Dir a copy of the admin kubeconfig (same CA data and token)
// whose server is p, and returns its path: a replica started with "--kubeconfig="+path
// reaches the apiserver through p, so the test can cut it off alone. The apiserver's
// certificate is valid for 127.0.0.1, so TLS still verifies through the proxy.
func (s *Scenario) KubeconfigVia(p *FaultProxy) string {
	s.T.Helper()
	cfg, err := clientcmd.LoadFromFile(s.CP.KubeconfigPath())
	if err != nil {
		s.T.Fatalf("loading the admin kubeconfig: %v", err)
	}
	if len(cfg.Clusters) == 0 {
		s.T.Fatalf("admin kubeconfig %s has no cluster", s.CP.KubeconfigPath())
	}
	for _, c := range cfg.Clusters {
		c.Server = p.URL()
	}
	_, port, _ := net.SplitHostPort(p.Addr())
	path := filepath.Join(s.Dir, "via-"+port+".kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		s.T.Fatalf("writing the kubeconfig via the fault proxy: %v", err)
	}
	return path
}
