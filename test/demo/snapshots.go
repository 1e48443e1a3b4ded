package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// snapshotCapabilities are what the demo driver advertises: upstream's defaults of the test
// driver and snapshots (taken and listed), which the snapshotter needs.
func snapshotCapabilities() []csi.ControllerServiceCapability_RPC_Type {
	return append(testdriver.DefaultControllerCapabilities(),
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT, csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS)
}

// snapshots are a run's VolumeSnapshots: one per claim, named after it, of the run's
// VolumeSnapshotClass of its driver. The real snapshot-controller creates their contents,
// the snapshotter takes them.
type snapshots struct {
	client    snapclientset.Interface
	namespace string
	class     string
}

// newSnapshots creates the run's VolumeSnapshotClass of driver (deletion policy Delete).
func newSnapshots(ctx context.Context, client snapclientset.Interface, driver, namespace string) (*snapshots, error) {
	s := &snapshots{client: client, namespace: namespace, class: namespace + "-snapshots"}
	class := &snapv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: s.class}, Driver: driver,
		DeletionPolicy: snapv1.VolumeSnapshotContentDelete}
	if _, err := client.SnapshotV1().VolumeSnapshotClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("VolumeSnapshotClass %s: %w", s.class, err)
	}
	return s, nil
}

// take creates a VolumeSnapshot of each named claim, named after it.
func (s *snapshots) take(ctx context.Context, claims []string) error {
	for _, claim := range claims {
		vs := &snapv1.VolumeSnapshot{
			ObjectMeta: metav1.ObjectMeta{Name: claim},
			Spec: snapv1.VolumeSnapshotSpec{
				Source:                  snapv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To(claim)},
				VolumeSnapshotClassName: ptr.To(s.class),
			},
		}
		if _, err := s.client.SnapshotV1().VolumeSnapshots(s.namespace).Create(ctx, vs, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("VolumeSnapshot of claim %s: %w", claim, err)
		}
	}
	return nil
}

// readyNames are the named VolumeSnapshots that are ready to use; the error is the API's.
func (s *snapshots) readyNames(ctx context.Context, names []string) (map[string]bool, error) {
	list, err := s.client.SnapshotV1().VolumeSnapshots(s.namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	ready := map[string]bool{}
	for _, vs := range list.Items {
		if slices.Contains(names, vs.Name) && vs.Status != nil && ptr.Deref(vs.Status.ReadyToUse, false) {
			ready[vs.Name] = true
		}
	}
	return ready, nil
}

// ready counts the named VolumeSnapshots ready to use.
func (s *snapshots) ready(names []string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, _ := s.readyNames(ctx, names)
	return len(r)
}

// wait polls, for up to waitTimeout, until every named VolumeSnapshot is ready to use (the
// snapshot-controller copied the content's status, which the snapshotter wrote); the error
// names those that are not.
func (s *snapshots) wait(ctx context.Context, names []string) error {
	ctx, cancel := context.WithTimeout(ctx, waitTimeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		ready, err := s.readyNames(ctx, names)
		if err == nil && len(ready) == len(names) {
			return nil
		}
		select {
		case <-ctx.Done():
			var missing []string
			for _, n := range names {
				if !ready[n] {
					missing = append(missing, n)
				}
			}
			return fmt.Errorf("waiting until VolumeSnapshots are ready: %w; not ready: %s (last error: %v)",
				ctx.Err(), strings.Join(missing, ", "), err)
		case <-tick.C:
		}
	}
}

// snapshotting: VolumeSnapshots of the bound claims, in use by their Pods; the real
// snapshot-controller creates a content for each and the snapshotter takes the snapshot.
func (d *demo) snapshotting(lease string, names []string) phase {
	return phase{
		sidecar: "snapshotter", lease: lease, method: testdriver.MethodCreateSnapshot,
		title: fmt.Sprintf("VolumeSnapshots of the %d claims, in use", len(names)),
		names: names,
		give: func(ctx context.Context, names []string) (string, error) {
			if err := d.snaps.take(ctx, names); err != nil {
				return "", err
			}
			return fmt.Sprintf("created VolumeSnapshots of claims %s (VolumeSnapshotClass %s)", span(names), d.snaps.class), nil
		},
		how:   ": the snapshot-controller creates a VolumeSnapshotContent for each, the snapshotter takes the snapshot",
		wait:  d.snaps.wait,
		count: d.snaps.ready,
	}
}
