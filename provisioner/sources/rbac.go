// The warnings of a permission that upstream's RBAC of some v6 release does not grant: the
// guard writes and watches VolumeSnapshots, which releases before v6.2 may only read.

package sources

import (
	"context"
	"sync/atomic"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// forbiddenWarning logs a refusal by the API server's authorizer once at a level always
// shown, naming the missing permission and what it costs, and later ones at -v=4: the
// refusal repeats on every operation until the RBAC changes, and one clear line is what
// an operator needs.
type forbiddenWarning struct {
	warned atomic.Bool
	// permission is what to grant, e.g. "update on volumesnapshots.snapshot.storage.k8s.io".
	permission string
	// consequence says what the provisioner does without it.
	consequence string
}

func (w *forbiddenWarning) report(logger klog.Logger, err error, keysAndValues ...any) {
	kv := append([]any{"missingPermission", w.permission, "err", err.Error()}, keysAndValues...)
	if w.warned.CompareAndSwap(false, true) {
		logger.Info("Warning: the API server refused a request for lack of RBAC permission; "+w.consequence+". Grant it as upstream's RBAC does; this is logged once, later refusals at -v=4", kv...)
		return
	}
	logger.V(4).Info("Refused for lack of RBAC permission: "+w.consequence, kv...)
}

// watchErrorHandler is the snapshot informer's: a forbidden watch (upstream's RBAC before
// v6.2 grants get and list only) is warned about once; the reflector then relists with
// backoff, which keeps the cache fresh enough for the orphan sweep. Other errors are
// client-go's to report.
func (w *forbiddenWarning) watchErrorHandler(ctx context.Context, r *cache.Reflector, err error) {
	if apierrors.IsForbidden(err) {
		w.report(klog.FromContext(ctx), err)
		return
	}
	cache.DefaultWatchErrorHandler(ctx, r, err)
}
