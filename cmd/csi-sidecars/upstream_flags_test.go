package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/upstream"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// flagDefiners are the flag package's functions that define a flag, with the index of the
// flag's name among their arguments.
var flagDefiners = map[string]int{
	"Bool": 0, "Int": 0, "Int64": 0, "Uint": 0, "Uint64": 0, "String": 0, "Float64": 0, "Duration": 0, "Func": 0, "BoolFunc": 0,
	"BoolVar": 1, "IntVar": 1, "Int64Var": 1, "UintVar": 1, "Uint64Var": 1, "StringVar": 1, "Float64Var": 1, "DurationVar": 1,
	"Var": 1, "TextVar": 1,
}

// upstreamOwnFlags are the names of the flags the Go files of dir define through the
// standard flag package (flag.X or flag.CommandLine.X), sorted.
func upstreamOwnFlags(t *testing.T, dir string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	fset := token.NewFileSet()
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, file, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || !isFlagPackage(sel.X) {
				return true
			}
			i, ok := flagDefiners[sel.Sel.Name]
			if !ok || len(call.Args) <= i {
				return true
			}
			if lit, ok := call.Args[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
				if name, err := strconv.Unquote(lit.Value); err == nil && !slices.Contains(names, name) {
					names = append(names, name)
				}
			}
			return true
		})
	}
	slices.Sort(names)
	return names
}

// isFlagPackage tells whether x is the flag package or its CommandLine.
func isFlagPackage(x ast.Expr) bool {
	switch x := x.(type) {
	case *ast.Ident:
		return x.Name == "flag"
	case *ast.SelectorExpr:
		id, ok := x.X.(*ast.Ident)
		return ok && id.Name == "flag" && x.Sel.Name == "CommandLine"
	}
	return false
}

// The flag tables: every flag upstream's newest releases define in their command
// (external-attacher, external-provisioner, external-resizer and csi-snapshotter at the tags
// of internal/testkit/upstream) is a flag of the csi-sidecars subcommand that replaces it, and is
// named in the README. Their sources come from the Go module proxy (or the module cache).
func TestEveryFlagOfUpstreamsNewestReleasesIsOursAndInTheREADME(t *testing.T) {
	if testing.Short() {
		t.Skip("downloads upstream's releases from the Go module proxy")
	}
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	root := newRoot()
	for _, r := range upstream.AllReleases() {
		t.Run(r.String(), func(t *testing.T) {
			dir, err := r.Download()
			if err != nil {
				t.Fatal(err)
			}
			names := upstreamOwnFlags(t, filepath.Join(dir, "cmd", r.Cmd))
			if len(names) < 5 {
				t.Fatalf("found only %v in cmd/%s of %s: the parser no longer sees upstream's flags", names, r.Cmd, r)
			}
			sub, _, err := root.Find([]string{r.Sidecar})
			if err != nil || sub == root {
				t.Fatalf("no subcommand %s: %v", r.Sidecar, err)
			}
			for _, name := range names {
				if sub.Flags().Lookup(name) == nil && root.PersistentFlags().Lookup(name) == nil {
					t.Errorf("%s has --%s; csi-sidecars %s does not", r, name, r.Sidecar)
				}
				if !strings.Contains(string(readme), "`--"+name+"`") {
					t.Errorf("%s has --%s; the README's flag tables do not name it", r, name)
				}
			}
			if !strings.Contains(string(readme), r.Repo()) || !strings.Contains(string(readme), strings.TrimSuffix(r.Tag, ".0")) {
				t.Errorf("the README does not name %s", r)
			}
		})
	}
}

// livenessprobeV219 is what kubernetes-csi/livenessprobe v2.19.0 registers on its flag
// set, written down because it is no Go module the proxy serves: its own flags
// (cmd/livenessprobe/main.go), each with a value other than its default, then csi-lib-utils'
// --automaxprocs and component-base's logging flags (logsapi.AddGoFlags, JSON registered).
var livenessprobeV219 = struct {
	own, library []string
}{
	own: []string{
		"--probe-timeout=10s",
		"--csi-address=/csi/csi.sock",
		"--health-port=9898",
		"--metrics-address=:9809",
		"--http-endpoint=:8080",
		"--metrics-path=/lp-metrics",
	},
	library: []string{
		"--automaxprocs",
		"--logging-format=json",
		"--log-flush-frequency=10s",
		"--v=5",
		"--vmodule=main=6",
		"--log-text-split-stream=false",
		"--log-text-info-buffer-size=0",
		"--log-json-split-stream=false",
		"--log-json-info-buffer-size=0",
	},
}

// Every flag livenessprobe v2.19 has is a flag of `csi-sidecars livenessprobe` (its own or
// a shared one), takes the values upstream takes, and its own are named in the README.
func TestEveryLivenessprobeV219FlagIsOursAndInTheREADME(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	root := newRoot()
	sub, _, err := root.Find([]string{"livenessprobe"})
	if err != nil || sub == root {
		t.Fatalf("no subcommand livenessprobe: %v", err)
	}
	f := livenessprobeV219
	for _, arg := range slices.Concat(f.own, f.library) {
		name, _, _ := strings.Cut(strings.TrimPrefix(arg, "--"), "=")
		if sub.Flags().Lookup(name) == nil && root.PersistentFlags().Lookup(name) == nil {
			t.Errorf("livenessprobe v2.19.0 has --%s; csi-sidecars livenessprobe does not", name)
		}
		if slices.Contains(f.own, arg) && !strings.Contains(string(readme), "`--"+name+"`") {
			t.Errorf("livenessprobe v2.19.0 has --%s; the README's flag tables do not name it", name)
		}
	}
	if !strings.Contains(string(readme), "livenessprobe v2.19") {
		t.Error("the README does not name livenessprobe v2.19")
	}
	// Upstream refuses --http-endpoint with --health-port or --metrics-address (and
	// --vmodule with the json format), so the values are checked in groups that upstream
	// accepts.
	for _, args := range [][]string{
		{"--probe-timeout=10s", "--csi-address=/csi/csi.sock", "--health-port=9898", "--metrics-address=:9809", "--metrics-path=/lp-metrics"},
		{"--probe-timeout=10s", "--http-endpoint=:8080", "--metrics-path=/lp-metrics"},
		{"--health-port=9808", "--http-endpoint=:8080"},
		{"--automaxprocs", "--log-flush-frequency=10s", "--v=5", "--vmodule=main=6", "--log-text-split-stream=false", "--log-text-info-buffer-size=0",
			"--log-json-split-stream=false", "--log-json-info-buffer-size=0"},
		{"--logging-format=json"},
	} {
		if err := lifecycle.ValidateArgs(newRoot(), append([]string{"livenessprobe"}, args...)); err != nil {
			t.Errorf("livenessprobe %v: %v", args, err)
		}
	}
}
