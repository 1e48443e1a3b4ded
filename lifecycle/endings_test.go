package lifecycle

import (
	"os"
	"strings"
	"testing"
)

// The endings table of docs/promises.md is the one in member.go, row for row: every ending
// is a row, and no other place decides an exit code or the Lease.
func TestThePromisesShowTheEndingsTable(t *testing.T) {
	readme, err := os.ReadFile("../docs/promises.md")
	if err != nil {
		t.Fatal(err)
	}
	if want := endingsTable(); !strings.Contains(string(readme), want) {
		t.Errorf("docs/promises.md does not show the endings table; want exactly:\n%s", want)
	}
	for end, e := range endings {
		if e.what == "" {
			t.Errorf("ending %d has no row text", end)
		}
		if (e.lease == leaseKept || e.lease == leaseNotOurs) != (e.outcome != "") {
			t.Errorf("ending %q: a Lease kept or not ours has a drain outcome label, and only then", e.what)
		}
	}
}
