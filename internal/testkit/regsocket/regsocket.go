// Package regsocket tells what a process does with a registration socket of the kubelet's
// plugin folder and the hidden socket beside it through which csi-sidecars' registrar hands
// its socket over: whether it serves the socket, waits beside the one that does, or serves
// a socket whose file is gone. It reads the kernel's UNIX socket table (Linux only), for
// tests and the demo, which need to know a registrar's state without asking it.
package regsocket

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// The kernel's UNIX socket table, read through sock_diag (what ss -x reads): which
// process listens on which socket file, and who is connected to whom. A socket file
// says nothing of the socket behind it; the table ties a listening socket to the inode of
// the file it was bound as, which stays the same through renames and handovers and tells
// when that file was unlinked.

// Linux's sock_diag constants for AF_UNIX (linux/sock_diag.h, linux/unix_diag.h).
const (
	netlinkSockDiag   = 4  // NETLINK_SOCK_DIAG
	sockDiagByFamily  = 20 // SOCK_DIAG_BY_FAMILY
	udiagShowName     = 0x1
	udiagShowVFS      = 0x2
	udiagShowPeer     = 0x4
	unixDiagName      = 0
	unixDiagVFS       = 1
	unixDiagPeer      = 2
	tcpListen         = 10 // the state of a listening socket
	nlmsgHeaderLen    = 16
	unixDiagMsgLen    = 16
	unixDiagReqLen    = 24
	rtattrHeaderLen   = 4
	allSocketStates   = 0xffffffff
	netlinkRecvBuffer = 1 << 16
)

// unixSocket is one row of the table.
type unixSocket struct {
	ino       uint32 // the socket's own inode (socket:[ino] in /proc/<pid>/fd)
	listening bool
	name      string // the address it was bound to, or its listener's for an accepted one
	vfsIno    uint64 // the inode of the file it was bound as; 0 if none
	peer      uint32 // the socket it is connected to; 0 if none
}

// unixSockets reads the whole table, by socket inode.
func unixSockets() (map[uint32]unixSocket, error) {
	fd, err := syscall.Socket(syscall.AF_NETLINK, syscall.SOCK_DGRAM|syscall.SOCK_CLOEXEC, netlinkSockDiag)
	if err != nil {
		return nil, fmt.Errorf("sock_diag socket: %w", err)
	}
	defer syscall.Close(fd)
	req := make([]byte, nlmsgHeaderLen+unixDiagReqLen)
	ne := binary.NativeEndian
	ne.PutUint32(req[0:], uint32(len(req)))
	ne.PutUint16(req[4:], sockDiagByFamily)
	ne.PutUint16(req[6:], syscall.NLM_F_REQUEST|syscall.NLM_F_DUMP)
	ne.PutUint32(req[8:], 1) // sequence number
	req[16] = syscall.AF_UNIX
	ne.PutUint32(req[20:], allSocketStates)
	ne.PutUint32(req[28:], udiagShowName|udiagShowVFS|udiagShowPeer)
	if err := syscall.Sendto(fd, req, 0, &syscall.SockaddrNetlink{Family: syscall.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("sock_diag request: %w", err)
	}
	out := map[uint32]unixSocket{}
	buf := make([]byte, netlinkRecvBuffer)
	for {
		n, _, err := syscall.Recvfrom(fd, buf, 0)
		if err != nil {
			return nil, fmt.Errorf("sock_diag answer: %w", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return nil, fmt.Errorf("sock_diag answer: %w", err)
		}
		for _, m := range msgs {
			switch m.Header.Type {
			case syscall.NLMSG_DONE:
				return out, nil
			case syscall.NLMSG_ERROR:
				return nil, errors.New("sock_diag answered an error (is unix_diag available?)")
			}
			if s, ok := parseUnixDiag(m.Data); ok {
				out[s.ino] = s
			}
		}
	}
}

func parseUnixDiag(data []byte) (unixSocket, bool) {
	if len(data) < unixDiagMsgLen {
		return unixSocket{}, false
	}
	ne := binary.NativeEndian
	s := unixSocket{ino: ne.Uint32(data[4:]), listening: data[2] == tcpListen}
	for rest := data[unixDiagMsgLen:]; len(rest) >= rtattrHeaderLen; {
		l := int(ne.Uint16(rest[0:]))
		if l < rtattrHeaderLen || l > len(rest) {
			break
		}
		payload := rest[rtattrHeaderLen:l]
		switch ne.Uint16(rest[2:]) {
		case unixDiagName:
			s.name = strings.TrimRight(string(payload), "\x00")
		case unixDiagVFS:
			if len(payload) >= 4 {
				s.vfsIno = uint64(ne.Uint32(payload))
			}
		case unixDiagPeer:
			if len(payload) >= 4 {
				s.peer = ne.Uint32(payload)
			}
		}
		rest = rest[min((l+3)&^3, len(rest)):]
	}
	return s, true
}

// socketsOf are the inodes of the sockets process pid holds open.
func socketsOf(pid int) ([]uint32, error) {
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("open files of %d: %w", pid, err)
	}
	var out []uint32
	for _, e := range entries {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // closed meanwhile
		}
		if ino, ok := strings.CutPrefix(target, "socket:["); ok {
			if n, err := strconv.ParseUint(strings.TrimSuffix(ino, "]"), 10, 32); err == nil {
				out = append(out, uint32(n))
			}
		}
	}
	return out, nil
}

// fileIno is the inode of the file at path; 0 if there is none.
func fileIno(path string) uint64 {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return 0
	}
	return st.Ino
}

// View is what one process does with the registration socket's files.
type View struct {
	// Serves: it listens on the socket that is the file at the registration path.
	Serves bool
	// WaitsBeside: it is connected to the socket that is the file at the hidden next path,
	// beside the registrar that serves (csi-sidecars' handover).
	WaitsBeside bool
	// Unlinked: it listens on a socket bound as a file that is no longer at either path.
	Unlinked bool
}

// Of tells what process pid does with the socket files at path (the registration socket)
// and next (the hidden one beside it).
func Of(pid int, path, next string) (View, error) {
	table, err := unixSockets()
	if err != nil {
		return View{}, err
	}
	mine, err := socketsOf(pid)
	if err != nil {
		return View{}, err
	}
	pathIno, nextIno := fileIno(path), fileIno(next)
	// The names the listener at next was bound with (a connection to it carries its name).
	nextNames := map[string]bool{}
	for _, s := range table {
		if s.listening && s.vfsIno != 0 && s.vfsIno == nextIno {
			nextNames[s.name] = true
		}
	}
	var v View
	for _, ino := range mine {
		s, ok := table[ino]
		if !ok {
			continue
		}
		switch {
		case s.listening && s.vfsIno != 0 && s.vfsIno == pathIno:
			v.Serves = true
		case s.listening && s.vfsIno != 0 && s.vfsIno != nextIno:
			v.Unlinked = true
		case !s.listening && s.peer != 0 && nextNames[table[s.peer].name]:
			v.WaitsBeside = true
		}
	}
	return v, nil
}
