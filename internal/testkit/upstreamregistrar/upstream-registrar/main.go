// Command upstream-registrar runs the model of upstream's node-driver-registrar v2.17.0
// (package upstreamregistrar) as a process of its own, for tests.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstreamregistrar"
)

func main() {
	cfg, code, err := upstreamregistrar.ParseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		os.Exit(code)
	}
	os.Exit(upstreamregistrar.Run(context.Background(), cfg, os.Stderr, func(c chan<- os.Signal) {
		signal.Notify(c, syscall.SIGTERM)
	}))
}
