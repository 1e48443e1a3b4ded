package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// TestStart serves two sockets, calls through one, checks the journal file and
// that stopping removes the sockets.
func TestStart(t *testing.T) {
	dir := t.TempDir()
	journal := filepath.Join(dir, "journal.jsonl")
	o, err := parse(t, "--endpoint", filepath.Join(dir, "a.sock")+","+filepath.Join(dir, "b.sock"), "--journal", journal)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	shutdown, err := start(o)
	if err != nil {
		t.Fatalf("start: %v", err)
	}

	conn, err := grpc.NewClient("unix://"+o.endpoints[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	info, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil || info.GetName() != testdriver.DefaultDriverName {
		t.Fatalf("GetPluginInfo: %v, %v", info, err)
	}

	shutdown()
	for _, p := range o.endpoints {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("socket %s after stop: %v", p, err)
		}
	}
	f, err := os.Open(journal)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	if !sc.Scan() {
		t.Fatal("empty journal file")
	}
	var c testdriver.Call
	if err := json.Unmarshal(sc.Bytes(), &c); err != nil || c.Method != testdriver.MethodGetPluginInfo || c.Socket != o.endpoints[1] || c.Code != "OK" {
		t.Errorf("journal line %q: %+v, %v", sc.Text(), c, err)
	}
}

// TestStartFailureCleansUp checks that a failing endpoint leaves no socket of
// the endpoints served before it.
func TestStartFailureCleansUp(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "a.sock")
	o, err := parse(t, "--endpoint", good, "--endpoint", filepath.Join(dir, "missing", "b.sock"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := start(o); err == nil {
		t.Fatal("start succeeded with an endpoint in a missing directory")
	}
	if _, err := os.Stat(good); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket %s left behind: %v", good, err)
	}
}
