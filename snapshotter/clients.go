package snapshotter

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	snapinformers "github.com/kubernetes-csi/external-snapshotter/client/v8/informers/externalversions"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// managedByLabel is the label by which the snapshot-controller tells a node-deployed
// snapshotter which contents are its node's (upstream's name).
const managedByLabel = "snapshot.storage.kubernetes.io/managed-by"

// clients are the snapshotter's API clients and informer factories. The snapshot kinds are
// custom resources, so their informers are not on the core's shared factory: they run on
// every replica from Setup until the process ends (Env.Done), as the core's do (P7).
type clients struct {
	snap snapclientset.Interface
	kube kubernetes.Interface
	// contentFactory watches the contents (on a node deployment only this node's);
	// classFactory the classes.
	contentFactory, classFactory snapinformers.SharedInformerFactory
}

func newClients(env *lifecycle.Env, resync time.Duration, nodeName string) (*clients, error) {
	snap, err := snapclientset.NewForConfig(env.RestConfig)
	if err != nil {
		return nil, fmt.Errorf("building the snapshot clientset: %w", err)
	}
	// Trimmed as the core's shared caches are, sharing their table of repeated maps: a
	// standby keeps every content in memory.
	transform := env.CacheTransform
	if transform == nil {
		transform = lifecycle.TrimForCache
	}
	trim := snapinformers.WithTransform(transform)
	c := &clients{snap: snap, kube: env.Kube, classFactory: snapinformers.NewSharedInformerFactoryWithOptions(snap, resync, trim)}
	c.contentFactory = c.classFactory
	if nodeName != "" {
		c.contentFactory = snapinformers.NewSharedInformerFactoryWithOptions(snap, resync, trim,
			snapinformers.WithTweakListOptions(func(o *metav1.ListOptions) {
				o.LabelSelector = labels.Set{managedByLabel: nodeName}.AsSelector().String()
			}))
	}
	return c, nil
}

// start runs every informer requested so far until stop closes.
func (c *clients) start(stop <-chan struct{}) {
	c.contentFactory.Start(stop)
	c.classFactory.Start(stop)
}

// groupSnapshotsServed tells whether the API server serves the group snapshot kinds this
// sidecar reads, as upstream checks them: a list of one of each.
func (c *clients) groupSnapshotsServed(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	one := metav1.ListOptions{Limit: 1}
	if _, err := c.snap.GroupsnapshotV1().VolumeGroupSnapshotContents().List(ctx, one); err != nil {
		return err
	}
	_, err := c.snap.GroupsnapshotV1().VolumeGroupSnapshotClasses().List(ctx, one)
	return err
}

// groupSnapshotsSupported asks the driver whether it takes group snapshots; a driver
// without the group controller service answers no.
func groupSnapshotsSupported(env *lifecycle.Env, timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(env.Ops(), timeout)
	defer cancel()
	rsp, err := csi.NewGroupControllerClient(env.CSI).GroupControllerGetCapabilities(ctx, &csi.GroupControllerGetCapabilitiesRequest{})
	if err != nil {
		return false
	}
	for _, c := range rsp.GetCapabilities() {
		if c.GetRpc().GetType() == csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT {
			return true
		}
	}
	return false
}
