package registrar

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
)

// handoverTimeout bounds one handover: the socket is sent and the next registrar says it
// has it.
const handoverTimeout = 2 * time.Second

// successors are the registrars that wait beside this one to be handed its socket: each is
// connected to the hidden next socket.
type successors struct {
	mu    sync.Mutex
	conns []*net.UnixConn
}

// acceptSuccessors collects the registrars that connect to next until it is closed.
func acceptSuccessors(next *net.UnixListener) *successors {
	s := &successors{}
	go func() {
		for {
			conn, err := next.AcceptUnix()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns = append(s.conns, conn)
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *successors) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.conns {
		c.Close()
	}
	s.conns = nil
}

// handOver sends both listening sockets of h to the first waiting registrar that takes
// them: the same open sockets, so the file at path does not change and the kubelet sees
// nothing. It reports whether one took them.
func (s *successors) handOver(ctx context.Context, h *held) bool {
	s.mu.Lock()
	conns := append([]*net.UnixConn(nil), s.conns...)
	s.mu.Unlock()
	if len(conns) == 0 {
		return false
	}
	lis, err := h.lis.File()
	if err != nil {
		return false
	}
	defer lis.Close()
	next, err := h.next.File()
	if err != nil {
		return false
	}
	defer next.Close()
	rights := syscall.UnixRights(int(lis.Fd()), int(next.Fd()))
	for _, c := range conns {
		if ctx.Err() != nil {
			return false
		}
		_ = c.SetDeadline(time.Now().Add(handoverTimeout))
		if _, _, err := c.WriteMsgUnix([]byte{1}, rights, nil); err != nil {
			continue // that one is gone
		}
		ack := make([]byte, 1)
		if n, err := c.Read(ack); err == nil && n == 1 {
			return true
		}
	}
	return false
}

// awaitHandover waits beside the registrar that serves path to be handed its sockets. It
// returns nil when that registrar hands nothing over (it ended without doing so, or it
// offers no handover, as upstream's), after which acquire looks at path again.
func (k *keeper) awaitHandover(ctx context.Context) *held {
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: k.nextPath, Net: "unix"})
	if err != nil {
		select {
		case <-ctx.Done():
		case <-time.After(k.checkEvery):
		}
		return nil
	}
	defer conn.Close()
	defer context.AfterFunc(ctx, func() { conn.Close() })()
	buf := make([]byte, 1)
	oob := make([]byte, syscall.CmsgSpace(2*4))
	n, oobn, _, _, err := conn.ReadMsgUnix(buf, oob)
	if err != nil || n == 0 {
		return nil
	}
	lis, next, err := listenersFrom(oob[:oobn])
	if err != nil {
		return nil
	}
	if _, err := conn.Write([]byte{1}); err != nil {
		// The other one gave up on the handover and keeps serving: leave it to it.
		lis.Close()
		next.Close()
		return nil
	}
	fi, err := os.Lstat(k.path)
	if err != nil {
		lis.Close()
		next.Close()
		return nil
	}
	return &held{lis: lis, next: next, file: fi}
}

// listenersFrom turns the two sockets of a handover message into listeners.
func listenersFrom(oob []byte) (lis, next *net.UnixListener, err error) {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil || len(msgs) != 1 {
		return nil, nil, errors.Join(errors.New("malformed handover message"), err)
	}
	fds, err := syscall.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 2 {
		for _, fd := range fds {
			syscall.Close(fd)
		}
		return nil, nil, errors.Join(errors.New("malformed handover message"), err)
	}
	lis, err = fileListener(fds[0])
	if err != nil {
		syscall.Close(fds[1])
		return nil, nil, err
	}
	if next, err = fileListener(fds[1]); err != nil {
		lis.Close()
		return nil, nil, err
	}
	return lis, next, nil
}

func fileListener(fd int) (*net.UnixListener, error) {
	f := os.NewFile(uintptr(fd), "handed-over socket")
	defer f.Close()
	l, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("using a handed-over socket: %w", err)
	}
	ul, ok := l.(*net.UnixListener)
	if !ok {
		l.Close()
		return nil, errors.New("a handed-over socket is no UNIX socket")
	}
	ul.SetUnlinkOnClose(false)
	return ul, nil
}
