package provisioner

import (
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/csi-sidecars/csi-sidecars/internal/queuenames"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/cachetest"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Every queue of the provisioner is the core's (lifecycle.NewQueue): client-go's workqueue
// metrics under upstream's names where upstream has the queue, and the sidecar's backlog.
// Capacity tracking's queue is tested in its package.
func TestEveryQueueReportsItsMetricsUnderUpstreamsNamesAndItsBacklog(t *testing.T) {
	names := &queuenames.Recorder{}
	backlog := &lifecycle.Backlog{}
	var o options
	if err := newFlagSet(&o).Parse(nil); err != nil {
		t.Fatal(err)
	}
	kube := fake.NewClientset()
	factory := informers.NewSharedInformerFactoryWithOptions(kube, 0, informers.WithTransform(cachetest.Transform()))
	c, err := newController(config{opts: o, driver: drv, kube: kube, queueMetrics: names, backlog: backlog}, factory)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"claims", "volumes", "provisioner-sources"} {
		if !slices.Contains(names.Names(), want) {
			t.Errorf("queues %v, want one named %q (the workqueue metric label)", names.Names(), want)
		}
	}
	c.claimQueue.Add("uid-1")
	c.sources.Queue().Add("pvc/ns/src")
	waiting := map[string]int{}
	for _, q := range backlog.Now(time.Now()) {
		waiting[q.Queue] = q.Waiting
	}
	if diff := cmp.Diff(map[string]int{"claims": 1, "volumes": 0, "provisioner-sources": 1, "provisioner-records": 0, "provisioner-record-rewrites": 0}, waiting); diff != "" {
		t.Errorf("backlog (-want +got):\n%s", diff)
	}
}
