package kubelet

import (
	"testing"
	"time"
)

// Absences count from the first time the driver was seen, close when it comes back, and a
// running one ends at the time asked.
func TestPresenceAbsences(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	p := &Presence{}
	p.observe(false, at(0)) // not yet registered: no absence
	p.observe(true, at(1))
	p.observe(true, at(2)) // no change
	p.observe(false, at(3))
	p.observe(true, at(5))
	p.observe(false, at(8))
	if p.IsPresent() {
		t.Error("present after the last removal")
	}
	got := p.Absences(at(9))
	want := []Absence{{at(3), at(5)}, {at(8), at(9)}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("absences %v; want %v", got, want)
	}
	if d := Absent(got); d != 3*time.Second {
		t.Errorf("absent %v in all; want 3s", d)
	}
	if p.Absences(at(9))[1].To != at(9) || p.absences[1].To != (time.Time{}) {
		t.Error("Absences changed the running absence it closed for its answer")
	}
}
