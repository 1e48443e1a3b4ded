package lifecycle

import (
	"context"

	"github.com/go-logr/logr"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// bodyLogLevel is the verbosity from which client-go logs request and response bodies.
const bodyLogLevel = 8

// GetSecret reads a Secret so that its data never reaches a log, at any -v. client-go logs
// every response body at -v=8 and above (whole, as a hex dump of the protobuf, at -v=10),
// through the logger of the request's context; this read's logger stops below that level,
// so a Secret's body is never written while every other request keeps its -v=8+ logs.
// Every sidecar reads Secrets through it.
func GetSecret(ctx context.Context, kube kubernetes.Interface, namespace, name string) (*v1.Secret, error) {
	ctx = klog.NewContext(ctx, belowBodies(klog.FromContext(ctx)))
	return kube.CoreV1().Secrets(namespace).Get(ctx, name, metav1.GetOptions{})
}

// belowBodies is logger with every level from bodyLogLevel up turned off.
func belowBodies(logger klog.Logger) klog.Logger {
	if logger.GetSink() == nil {
		return logger
	}
	return logr.New(cappedSink{LogSink: logger.GetSink(), below: bodyLogLevel})
}

// cappedSink is a LogSink that is off from level below up.
type cappedSink struct {
	logr.LogSink
	below int
}

// Init does nothing: the wrapped sink was set up by the logger it comes from, and is shared
// with it (setting it up again would write to it while others log through it).
func (s cappedSink) Init(logr.RuntimeInfo) {}

func (s cappedSink) Enabled(level int) bool { return level < s.below && s.LogSink.Enabled(level) }

func (s cappedSink) Info(level int, msg string, kv ...any) {
	if level < s.below {
		s.LogSink.Info(level, msg, kv...)
	}
}

func (s cappedSink) WithValues(kv ...any) logr.LogSink {
	return cappedSink{LogSink: s.LogSink.WithValues(kv...), below: s.below}
}

func (s cappedSink) WithName(name string) logr.LogSink {
	return cappedSink{LogSink: s.LogSink.WithName(name), below: s.below}
}

func (s cappedSink) WithCallDepth(depth int) logr.LogSink {
	if d, ok := s.LogSink.(logr.CallDepthLogSink); ok {
		return cappedSink{LogSink: d.WithCallDepth(depth), below: s.below}
	}
	return s
}
