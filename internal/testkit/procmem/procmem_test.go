package procmem

import (
	"os"
	"testing"
)

func TestParse(t *testing.T) {
	status := "Name:\tcsi-sidecars\nVmPeak:\t 1300000 kB\nVmHWM:\t   51200 kB\nVmRSS:\t   40960 kB\nRssAnon:\t   20480 kB\nRssFile:\t   20480 kB\nThreads:\t12\n"
	want := Memory{Peak: 50 << 20, Now: 40 << 20, Anon: 20 << 20, File: 20 << 20}
	if got := parse(status); got != want {
		t.Errorf("parse: %+v, want %+v", got, want)
	}
}

func TestReadsItsOwnProcess(t *testing.T) {
	m, err := Read(os.Getpid())
	if err != nil {
		t.Skipf("no /proc here: %v", err)
	}
	if m.Peak <= 0 || m.Now <= 0 || m.Now > m.Peak {
		t.Errorf("own memory %+v: want 0 < now <= peak", m)
	}
	if Peak(-1) != 0 {
		t.Errorf("Peak of no process is not 0")
	}
}
