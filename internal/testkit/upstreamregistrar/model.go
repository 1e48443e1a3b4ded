// Package upstreamregistrar is a MODEL of upstream's node-driver-registrar v2.17.0
// (kubernetes-csi/node-driver-registrar, cmd/csi-node-driver-registrar): what it does at
// each step a node DaemonSet's rollout touches, written for the tests, not upstream's code.
// Upstream's module is not on the Go module proxy, so it cannot be built here; tests that
// compare csi-sidecars' registrar with upstream's run this model instead, as a process of its
// own (the command upstream-registrar, which Build builds), since signals, SIGKILL and who
// owns a socket are per process.
//
// The steps it models, with their place at the v2.17.0 tag (NDR = cmd/csi-node-driver-registrar,
// CLU = vendored csi-lib-utils v0.24.0):
//
//  1. Flags --csi-address (default /run/csi/socket), --kubelet-registration-path (required:
//     exit 1 when empty), --plugin-registration-path (default /registration), --timeout
//     (default 1s) (NDR main.go:49-58, 134-137).
//  2. Connect to the driver, retrying about every second, for at most 30 s, else exit 1
//     (NDR main.go:163-170; CLU connection/connection.go:78-93, 157-259).
//  3. GetPluginInfo under --timeout; an error or an empty name exits 1 (NDR main.go:172;
//     CLU rpc/common.go:39-52). The driver connection is never used again.
//  4. The registration socket is "<plugin-registration-path>/<driver>-reg.sock", by string
//     formatting (NDR node_register.go:89-91).
//  5. Whatever socket file is at that path is removed; a file that is not a socket, or one
//     that cannot be removed, exits 1 (pkg/util/util_unix.go:33-58; node_register.go:45-48).
//  6. It listens there with the umask set to 0077 (node_register.go:38-87).
//  7. GetInfo answers CSIPlugin, the driver name, --kubelet-registration-path and version
//     1.0.0 (NDR main.go:88-98).
//  8. NotifyRegistrationStatus(false) exits 1 at once, leaving the socket
//     (NDR main.go:100-109).
//  9. SIGTERM, caught only once the socket listens, removes the socket file at the path and
//     exits 0 (1 if removing fails other than for a missing file); SIGINT is not caught,
//     so it kills the process and leaves the socket (node_register.go:179-190).
//  10. A Serve error exits 1 (node_register.go:80-86).
//
// Not modelled: /healthz, --health-port, --http-endpoint, pprof, the logging flags, --mode,
// --version and --connection-timeout.
package upstreamregistrar

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// connectTimeout is upstream's fixed deadline for reaching the driver (step 2).
const connectTimeout = 30 * time.Second

// Config is the model's flags (step 1).
type Config struct {
	CSIAddress              string
	KubeletRegistrationPath string
	PluginRegistrationPath  string
	Timeout                 time.Duration
}

// ParseFlags parses args as upstream's flags: a parse error exits 2, as Go's flag package
// does on its own.
func ParseFlags(args []string, output io.Writer) (Config, int, error) {
	fs := flag.NewFlagSet("upstream-registrar", flag.ContinueOnError)
	fs.SetOutput(output)
	var c Config
	fs.StringVar(&c.CSIAddress, "csi-address", "/run/csi/socket", "Path of the CSI driver socket.")
	fs.StringVar(&c.KubeletRegistrationPath, "kubelet-registration-path", "", "Path of the CSI driver socket on the host.")
	fs.StringVar(&c.PluginRegistrationPath, "plugin-registration-path", "/registration", "The kubelet's plugin registration folder.")
	fs.DurationVar(&c.Timeout, "timeout", time.Second, "Timeout of the driver's GetPluginInfo.")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, 0, err
		}
		return c, 2, err
	}
	return c, 0, nil
}

// SocketPath is where the model places the registration socket of driver (step 4).
func (c Config) SocketPath(driver string) string {
	return fmt.Sprintf("%s/%s-reg.sock", c.PluginRegistrationPath, driver)
}

// Run is the model's process from its flags on and returns its exit code. catchSIGTERM is
// called once the socket listens, with the channel SIGTERM must be delivered on (the
// command passes signal.Notify); before that a SIGTERM keeps Go's default, as upstream's.
// Errors are written to logw.
func Run(ctx context.Context, c Config, logw io.Writer, catchSIGTERM func(chan<- os.Signal)) int {
	fail := func(format string, args ...any) int {
		fmt.Fprintf(logw, format+"\n", args...)
		return 1
	}
	if c.KubeletRegistrationPath == "" {
		return fail("kubelet-registration-path is a required parameter")
	}
	conn, err := connect(ctx, c.CSIAddress)
	if err != nil {
		return fail("Error connecting to CSI driver: %v", err)
	}
	// Never closed, as upstream's: the process keeps it until it ends.
	infoCtx, cancel := context.WithTimeout(ctx, c.Timeout)
	info, err := csi.NewIdentityClient(conn).GetPluginInfo(infoCtx, &csi.GetPluginInfoRequest{})
	cancel()
	if err == nil && info.GetName() == "" {
		err = errors.New("driver name is empty")
	}
	if err != nil {
		return fail("Error retreiving CSI driver name: %v", err)
	}
	driver := info.GetName()
	path := c.SocketPath(driver)
	if err := cleanupSocketFile(path); err != nil {
		return fail("%v", err)
	}
	old := syscall.Umask(0o077)
	lis, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return fail("Failed to listen on socket: %s: %v", path, err)
	}
	// The socket file is removed by the SIGTERM handler only, as upstream's.
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	fmt.Fprintf(logw, "Registration server started at: %s\n", path)

	failed := make(chan struct{}, 1)
	srv := grpc.NewServer()
	registerapi.RegisterRegistrationServer(srv, &registration{driver: driver, endpoint: c.KubeletRegistrationPath, failed: failed, logw: logw})
	sigterm := make(chan os.Signal, 1)
	catchSIGTERM(sigterm)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	select {
	case <-sigterm:
		// No graceful stop: the file goes, then the process (whose end closes every
		// connection: Stop, for a Run in a test process).
		defer srv.Stop()
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fail("failed to remove socket: %s with error: %v", path, err)
		}
		return 0
	case <-failed:
		srv.Stop()
		return fail("Registration process failed with error, restarting registration container")
	case err := <-served:
		if err != nil {
			return fail("Registration server stopped: %v", err)
		}
		return 0
	case <-ctx.Done():
		// Only in tests: the process itself has no other way out.
		srv.Stop()
		return 0
	}
}

// connect waits for the driver's socket to accept a connection, trying about every second
// for at most connectTimeout, and returns a client of it (step 2).
func connect(ctx context.Context, address string) (*grpc.ClientConn, error) {
	path := strings.TrimPrefix(address, "unix://")
	ctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	for {
		c, err := (&net.Dialer{}).DialContext(ctx, "unix", path)
		if err == nil {
			c.Close()
			break
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w", path, err)
	}
	return conn, nil
}

// cleanupSocketFile removes the socket at path, if any (step 5).
func cleanupSocketFile(path string) error {
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return fmt.Errorf("failed to stat the socket %s with error: %w", path, err)
	case fi.Mode()&fs.ModeSocket == 0:
		return fmt.Errorf("file exists in socketPath %s but it's not a socket.", path) //nolint:staticcheck // upstream's words
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("failed to remove stale socket %s with error: %w", path, err)
	}
	return nil
}

// registration is the kubelet's plugin registration service (steps 7 and 8).
type registration struct {
	registerapi.UnimplementedRegistrationServer
	driver, endpoint string
	failed           chan<- struct{}
	logw             io.Writer
}

func (r *registration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.driver,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (r *registration) NotifyRegistrationStatus(ctx context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	fmt.Fprintf(r.logw, "Received NotifyRegistrationStatus call: %v\n", st)
	if !st.GetPluginRegistered() {
		// Upstream calls os.Exit(1) here: the caller gets no answer, its connection
		// ends with the process.
		select {
		case r.failed <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}
