package registrar

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// socketState is what a registration socket's path holds.
type socketState int

const (
	socketMissing   socketState = iota // no file
	socketStale                        // a socket file nobody listens on (its process ended)
	socketLive                         // a socket another process serves
	socketNotSocket                    // a file that is not a socket: upstream refuses it too
)

// keeper keeps one registration socket in place for the kubelet (see the package doc).
type keeper struct {
	path string
	// nextPath is the hidden socket on which the registrar that owns path hands it over to
	// the next one (the kubelet's plugin watcher ignores names that start with a dot).
	nextPath   string
	reg        *registration
	checkEvery time.Duration
}

func newKeeper(path string, reg *registration, checkEvery time.Duration) *keeper {
	dir, base := filepath.Split(path)
	return &keeper{
		path:       path,
		nextPath:   filepath.Join(dir, "."+strings.TrimSuffix(base, ".sock")+".next"),
		reg:        reg,
		checkEvery: checkEvery,
	}
}

// run keeps the socket until intake ends, then drains: it returns once what the kubelet
// was doing on the socket has ended.
func (k *keeper) run(intake, ops context.Context) error {
	for {
		held, err := k.acquire(intake)
		if err != nil || held == nil {
			return err
		}
		lost, err := k.own(intake, ops, held)
		if err != nil || !lost {
			return err
		}
	}
}

// probe tells what path holds.
func probe(path string) (socketState, error) {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return socketMissing, nil
	case err != nil:
		return 0, fmt.Errorf("checking the registration socket %s: %w", path, err)
	case fi.Mode()&fs.ModeSocket == 0:
		return socketNotSocket, nil
	}
	conn, err := net.DialTimeout("unix", path, time.Second)
	switch {
	case err == nil:
		conn.Close()
		return socketLive, nil
	case errors.Is(err, syscall.ECONNREFUSED):
		return socketStale, nil
	case errors.Is(err, fs.ErrNotExist):
		return socketMissing, nil
	}
	// Neither answering nor refusing (a full backlog, a timeout): someone is there.
	return socketLive, nil
}

// acquire returns the socket once this registrar serves it: placed anew where there was no
// file or a file nobody serves, or handed over by the registrar that serves it. It
// returns nil when intake ends first.
func (k *keeper) acquire(intake context.Context) (*held, error) {
	logger := klog.FromContext(intake)
	waiting := false
	for intake.Err() == nil {
		state, err := probe(k.path)
		if err != nil {
			return nil, err
		}
		switch state {
		case socketNotSocket:
			return nil, fmt.Errorf("file exists in socketPath %s but it's not a socket", k.path)
		case socketMissing, socketStale:
			h, err := k.place(state == socketStale)
			if errors.Is(err, fs.ErrExist) {
				continue // another process placed one meanwhile: look again
			}
			if err == nil {
				logger.Info("Placed the registration socket", "path", k.path, "replacedAStaleOne", state == socketStale)
			}
			return h, err
		case socketLive:
			if !waiting {
				logger.Info("Another process serves the registration socket: waiting beside it to be handed it, or for it to go", "path", k.path)
				waiting = true
			}
			if h := k.awaitHandover(intake); h != nil {
				logger.Info("Was handed the registration socket", "path", k.path)
				return h, nil
			}
		}
	}
	return nil, nil
}

// held is a registration socket this registrar serves: the listener on path, the listener
// on nextPath, and the file at path they were placed as.
type held struct {
	lis  *net.UnixListener
	next *net.UnixListener
	file os.FileInfo
}

func (h *held) close() {
	h.lis.Close()
	h.next.Close()
}

// listenAt listens on a new name in a hidden folder beside path and moves the socket to
// path: a rename replaces whatever is there in one step, a link only places it where there
// is nothing. The kubelet's plugin watcher sees one new file, never a removal, and nothing
// of the hidden folder, which it does not watch (the same file system, so the move works).
func listenAt(path string, replace bool) (*net.UnixListener, error) {
	dir := filepath.Join(filepath.Dir(path), ".csi-sidecars")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating %s: %w", dir, err)
	}
	tmp := filepath.Join(dir, fmt.Sprintf("%d-%d", os.Getpid(), time.Now().UnixNano()%1e6))
	lis, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", tmp, err)
	}
	// The file stays when the listener closes: only moves replace it.
	lis.SetUnlinkOnClose(false)
	err = os.Chmod(tmp, 0o700)
	if err == nil {
		if replace {
			err = os.Rename(tmp, path)
		} else {
			err = os.Link(tmp, path)
			_ = os.Remove(tmp)
		}
	}
	if err != nil {
		lis.Close()
		_ = os.Remove(tmp)
		return nil, fmt.Errorf("placing the socket at %s: %w", path, err)
	}
	return lis, nil
}

// place listens at path, replacing a stale socket when replace is set.
func (k *keeper) place(replace bool) (*held, error) {
	lis, err := listenAt(k.path, replace)
	if err != nil {
		return nil, err
	}
	fi, err := os.Lstat(k.path)
	if err != nil {
		lis.Close()
		return nil, fmt.Errorf("checking the registration socket %s: %w", k.path, err)
	}
	next, err := listenAt(k.nextPath, true)
	if err != nil {
		lis.Close()
		return nil, err
	}
	return &held{lis: lis, next: next, file: fi}, nil
}

// isOurs tells whether path is still the file h was placed as.
func (k *keeper) isOurs(h *held) bool {
	fi, err := os.Lstat(k.path)
	return err == nil && os.SameFile(fi, h.file)
}

// own serves the registration API on h until intake ends (then drains and returns lost
// false) or the socket is no longer at path (lost true: acquire it again).
func (k *keeper) own(intake, ops context.Context, h *held) (lost bool, err error) {
	logger := klog.FromContext(intake)
	srv := grpc.NewServer(grpc.StatsHandler(k.reg))
	registerapi.RegisterRegistrationServer(srv, k.reg)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(h.lis) }()
	successors := acceptSuccessors(h.next)
	defer successors.close()
	ticker := time.NewTicker(k.checkEvery)
	defer ticker.Stop()
	for {
		select {
		case <-intake.Done():
			k.drain(ops, srv, h, successors)
			return false, nil
		case err := <-served:
			h.close()
			logger.Error(err, "The registration server stopped; placing the socket again", "path", k.path)
			return true, nil
		case <-ticker.C:
			if !k.isOurs(h) {
				srv.Stop()
				h.close()
				logger.Info("The registration socket was removed or replaced; registering again", "path", k.path)
				return true, nil
			}
		case err := <-k.reg.failed:
			// Upstream exits 1 for the kubelet to restart it; the socket stays, to be
			// replaced by the next start.
			stopWithin(ops, srv)
			h.close()
			return false, err
		}
	}
}

// drain ends this registrar's service: the socket goes to a registrar waiting beside it if
// there is one, else it stays at path, served until the registrations the kubelet runs have
// reported their status. Calls in flight end either way.
func (k *keeper) drain(ops context.Context, srv *grpc.Server, h *held, successors *successors) {
	logger := klog.FromContext(ops)
	if successors.handOver(ops, h) {
		logger.Info("Handed the registration socket over to the registrar waiting beside this one", "path", k.path)
	} else if err := k.reg.waitPending(ops); err != nil {
		logger.Error(err, "Stopping before the kubelet reported every registration")
	}
	stopWithin(ops, srv)
	h.close()
	logger.Info("Left the registration socket in place for the kubelet", "path", k.path)
}

// stopWithin stops srv once its calls in flight ended, or at once when ops ends.
func stopWithin(ops context.Context, srv *grpc.Server) {
	stopped := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-ops.Done():
		srv.Stop()
	}
}

// check is the health check: the socket at path answers GetInfo with the driver's name
// (this registrar's, or the one it waits beside), as upstream's /healthz checks.
func (k *keeper) check(ctx context.Context, driver string, timeout time.Duration) error {
	state, err := probe(k.path)
	if err != nil {
		return err
	}
	if state != socketLive {
		return fmt.Errorf("registration socket %s does not answer", k.path)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+k.path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("error connecting to node-registrar socket %s: %w", k.path, err)
	}
	defer conn.Close()
	ctx = metadata.AppendToOutgoingContext(ctx, healthCheckKey, "1")
	info, err := registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		return fmt.Errorf("error getting info from node-registrar socket: %w", err)
	}
	if info.GetName() != driver {
		return fmt.Errorf("invalid driver name %s", info.GetName())
	}
	return nil
}
