package budget

import (
	"context"
	"sync/atomic"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// NewEventBroadcaster records events into namespace ("" for the objects' own) through a
// sink that tolerates RBAC without events. Its writes wait for the budget as events (P14):
// behind every write that records a result, ahead of new work.
func NewEventBroadcaster(ctx context.Context, kube kubernetes.Interface, namespace string) record.EventBroadcaster {
	b := record.NewBroadcaster(record.WithContext(ctx))
	b.StartRecordingToSink(&tolerantSink{events: kube.CoreV1().Events(namespace), ctx: eventWrites(ctx), logger: klog.FromContext(ctx)})
	return b
}

// tolerantSink writes events unless RBAC does not allow it: upstream's external-attacher
// role, for one, grants no events. Then it logs one warning and drops events from then on,
// instead of a refusal in the log per event; no work depends on an event.
type tolerantSink struct {
	events typedcorev1.EventInterface
	// ctx is the context of every write: the budget's class of events.
	ctx     context.Context
	logger  klog.Logger
	refused atomic.Bool
}

func (s *tolerantSink) Create(e *v1.Event) (*v1.Event, error) {
	return s.write(e, func() (*v1.Event, error) { return s.events.CreateWithEventNamespaceWithContext(s.ctx, e) })
}

func (s *tolerantSink) Update(e *v1.Event) (*v1.Event, error) {
	return s.write(e, func() (*v1.Event, error) { return s.events.UpdateWithEventNamespaceWithContext(s.ctx, e) })
}

func (s *tolerantSink) Patch(e *v1.Event, data []byte) (*v1.Event, error) {
	return s.write(e, func() (*v1.Event, error) { return s.events.PatchWithEventNamespaceWithContext(s.ctx, e, data) })
}

func (s *tolerantSink) write(e *v1.Event, do func() (*v1.Event, error)) (*v1.Event, error) {
	if s.refused.Load() {
		return e, nil
	}
	written, err := do()
	if apierrors.IsForbidden(err) {
		if s.refused.CompareAndSwap(false, true) {
			s.logger.Info("Warning: RBAC does not allow writing events here; events are not recorded from now on", "namespace", e.Namespace, "reason", e.Reason)
		}
		return e, nil
	}
	return written, err
}
