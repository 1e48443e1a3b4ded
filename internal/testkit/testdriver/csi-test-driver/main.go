// Command csi-test-driver serves the project's fake CSI driver
// (internal/testkit/testdriver) on one or more UNIX sockets that share one in-memory
// backend, for end-to-end tests and demos of the sidecars.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

func main() {
	fs := flag.NewFlagSet(os.Args[0], flag.ExitOnError)
	klog.InitFlags(fs)
	opts, err := parseFlags(fs, os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", os.Args[0], err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, opts); err != nil {
		klog.ErrorS(err, "Test driver failed")
		klog.Flush()
		os.Exit(1)
	}
	klog.Flush()
}

// run serves the driver until ctx ends, then stops every server, which
// removes the sockets.
func run(ctx context.Context, opts options) error {
	shutdown, err := start(opts)
	if err != nil {
		return err
	}
	defer shutdown()
	klog.InfoS("Test driver running", "driver", opts.config.DriverName, "endpoints", opts.endpoints)
	<-ctx.Done()
	klog.InfoS("Test driver stopping")
	return nil
}

// start opens the journal and serves the driver on every endpoint. shutdown
// stops the servers, removing their sockets, and closes the journal.
func start(opts options) (_ func(), err error) {
	var cleanups []func()
	shutdown := func() {
		// Last opened, first closed: servers stop before the journal
		// they write to is closed.
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}
	defer func() {
		if err != nil {
			shutdown()
		}
	}()

	if opts.journalPath != "" {
		f, err := os.OpenFile(opts.journalPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		if err != nil {
			return nil, fmt.Errorf("opening journal: %w", err)
		}
		cleanups = append(cleanups, func() { closeJournal(f) })
		opts.config.JournalWriter = f
	}
	b, err := testdriver.New(opts.config)
	if err != nil {
		return nil, err
	}
	for _, path := range opts.endpoints {
		srv, err := b.Serve(path)
		if err != nil {
			return nil, fmt.Errorf("serving driver %s: %w", b.DriverName(), err)
		}
		cleanups = append(cleanups, srv.Stop)
	}
	return shutdown, nil
}

func closeJournal(f io.Closer) {
	if err := f.Close(); err != nil {
		klog.ErrorS(err, "Closing journal")
	}
}
