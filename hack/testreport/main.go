// Command testreport reads `go test -json` from stdin, prints what go test prints without
// -v (the output of failed tests, a line per package), and ends with the slowest tests and
// packages, so that whoever runs `make test` sees where the time goes. It exits 1 when a
// test, a package or the input failed.
//
//	go test -json ./... | go run ./hack/testreport -slowest 10
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"
)

// event is one line of `go test -json` (cmd/test2json).
type event struct {
	Action  string
	Package string
	Test    string
	Elapsed float64
	Output  string
}

type result struct {
	name    string
	elapsed time.Duration
}

func main() {
	slowest := flag.Int("slowest", 10, "how many of the slowest tests and packages to list at the end")
	flag.Parse()
	code, err := report(os.Stdin, os.Stdout, *slowest)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testreport:", err)
		code = 1
	}
	os.Exit(code)
}

// report copies the output of the events in r to w, then lists the n slowest top-level
// tests and packages. Its code is 1 if anything failed.
func report(r io.Reader, w io.Writer, n int) (int, error) {
	var tests, packages []result
	failed := false
	// held is each running test's output, printed if it fails.
	held := map[string]*strings.Builder{}
	scanner := bufio.NewScanner(r)
	scanner.Buffer(make([]byte, 1<<20), 16<<20)
	for scanner.Scan() {
		line := scanner.Bytes()
		var e event
		if err := json.Unmarshal(line, &e); err != nil {
			// Not an event: a build error or a line of the go command itself.
			fmt.Fprintln(w, string(line))
			continue
		}
		key := e.Package + " " + e.Test
		switch {
		case e.Test == "" && e.Output != "PASS\n":
			fmt.Fprint(w, e.Output)
		case e.Test != "" && e.Output != "":
			if held[key] == nil {
				held[key] = &strings.Builder{}
			}
			held[key].WriteString(e.Output)
		}
		elapsed := time.Duration(e.Elapsed * float64(time.Second))
		switch e.Action {
		case "build-fail":
			failed = true
			continue
		case "fail":
			failed = true
			if out := held[key]; out != nil {
				fmt.Fprint(w, out.String())
			}
		case "pass", "skip":
		default:
			continue
		}
		delete(held, key)
		switch {
		case e.Test == "":
			packages = append(packages, result{e.Package, elapsed})
		case !strings.Contains(e.Test, "/"):
			tests = append(tests, result{e.Package + " " + e.Test, elapsed})
		}
	}
	if err := scanner.Err(); err != nil {
		return 1, fmt.Errorf("reading the events: %w", err)
	}
	list(w, "slowest tests", tests, n)
	list(w, "slowest packages", packages, n)
	if failed {
		return 1, nil
	}
	return 0, nil
}

func list(w io.Writer, title string, results []result, n int) {
	if len(results) == 0 || n <= 0 {
		return
	}
	slices.SortStableFunc(results, func(a, b result) int { return int(b.elapsed - a.elapsed) })
	fmt.Fprintf(w, "\n%d %s:\n", min(n, len(results)), title)
	for _, r := range results[:min(n, len(results))] {
		fmt.Fprintf(w, "  %8s  %s\n", r.elapsed.Round(100*time.Millisecond), r.name)
	}
}
