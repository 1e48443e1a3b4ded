// Package logtest captures what a component logs, for the tests of logging itself: which
// lines a CSI call writes at a verbosity, and that no secret is among them. Other tests
// assert on outcomes, never on logs.
package logtest

import (
	"bytes"
	"sync"

	"github.com/go-logr/logr"
	"k8s.io/klog/v2/textlogger"
)

// Buffer is a bytes.Buffer that loggers may write from several goroutines while a test
// reads it.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String is what was written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Bytes is a copy of what was written so far.
func (b *Buffer) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return bytes.Clone(b.buf.Bytes())
}

// Logger is a text logger at verbosity v writing into the returned buffer.
func Logger(v int) (logr.Logger, *Buffer) {
	out := &Buffer{}
	return textlogger.NewLogger(textlogger.NewConfig(textlogger.Verbosity(v), textlogger.Output(out))), out
}
