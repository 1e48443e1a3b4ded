// The provisioner's configuration: what every part needs from the outside world.

package provisioner

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	eventrecord "k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	gatewayclientset "sigs.k8s.io/gateway-api/pkg/client/clientset/versioned"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/csi-sidecars/csi-sidecars/provisioner/request"
)

// config is what the controller needs from the outside world; Setup fills it from the
// core's Env, tests fill it themselves.
type config struct {
	opts   options
	driver string
	// inTree is the in-tree plugin the driver replaces (CSI migration), "" for none.
	inTree   string
	identity string // this instance, recorded in volume attributes
	kube     kubernetes.Interface
	csi      csi.ControllerClient
	ops      context.Context // parent of every CSI call and the writes recording it (P1)
	recorder eventrecord.EventRecorder
	// eventSource is the recorder's source, also that of the record's events.
	eventSource    v1.EventSource
	metrics        *controllerMetrics
	pluginCaps     rpc.PluginCapabilitySet
	controllerCaps rpc.ControllerCapabilitySet
	topology       bool // the driver reports topology and the Topology gate is on
	vac            bool // the VolumeAttributesClass gate is on
	// node is set with --node-deployment.
	node *localNode
	// snapshotClient is set when the driver restores snapshots and the cluster serves
	// the VolumeSnapshot API.
	snapshotClient snapclientset.Interface
	// grantClient reads ReferenceGrants; set with the CrossNamespaceVolumeDataSource gate.
	grantClient gatewayclientset.Interface
	// queueMetrics is where the queues report; nil is client-go's process-wide provider.
	queueMetrics workqueue.MetricsProvider
	// backlog is where the queues report what waits for a worker (Env.Backlog); nil: nowhere.
	backlog *lifecycle.Backlog
	// capacity is told which capacity a provisioning or deletion changed; nil without
	// --enable-capacity.
	capacity capacityRefresher
}

// capacityRefresher asks capacity tracking for GetCapacity again, soon rather than at the
// next poll, where a volume was made or deleted: the segments of topology (all of the
// class's for none) of one StorageClass. It only enqueues: it is called on the worker
// that did the operation, and starts nothing.
type capacityRefresher interface {
	Refresh(class string, topology []*csi.Topology)
}

// names are the names a claim, class or PersistentVolume may give the driver.
func (c *config) names() request.DriverNames {
	return request.DriverNames{Driver: c.driver, InTree: c.inTree}
}

// capacityChanged tells capacity tracking, if on, that an operation changed capacity.
func (c *config) capacityChanged(class string, topology []*csi.Topology) {
	if c.capacity != nil && class != "" {
		c.capacity.Refresh(class, topology)
	}
}

// deleteBackendVolume deletes a volume that has no PersistentVolume, on Ops() (P1).
func (c *config) deleteBackendVolume(ctx context.Context, id string, secrets map[string]string) error {
	callCtx, cancel := context.WithTimeout(ctx, c.opts.timeout)
	defer cancel()
	_, err := c.csi.DeleteVolume(callCtx, &csi.DeleteVolumeRequest{VolumeId: id, Secrets: secrets})
	return err
}
