package request

import (
	"errors"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
)

func TestClaimSourceSaysWhatTheProvisionerDoesWithADataSource(t *testing.T) {
	for _, tc := range []struct {
		name    string
		claim   func(*v1.PersistentVolumeClaim)
		want    SourceRef
		wantErr string
		popul   bool
	}{
		{name: "no data source", claim: func(*v1.PersistentVolumeClaim) {}},
		{name: "clone by dataSource", claim: func(c *v1.PersistentVolumeClaim) {
			c.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: PVCKind, Name: "src"}
		}, want: SourceRef{Kind: SourceClone, Namespace: "ns", Name: "src"}},
		{name: "snapshot by dataSourceRef", claim: func(c *v1.PersistentVolumeClaim) {
			c.Spec.DataSourceRef = &v1.TypedObjectReference{APIGroup: ptr.To(SnapshotAPIGroup), Kind: SnapshotKind, Name: "snap"}
		}, want: SourceRef{Kind: SourceSnapshot, Namespace: "ns", Name: "snap"}},
		{name: "snapshot of another group", claim: func(c *v1.PersistentVolumeClaim) {
			c.Spec.DataSource = &v1.TypedLocalObjectReference{APIGroup: ptr.To("example.com"), Kind: SnapshotKind, Name: "snap"}
		}, wantErr: "right APIGroup"},
		{name: "populator", claim: func(c *v1.PersistentVolumeClaim) {
			c.Spec.DataSourceRef = &v1.TypedObjectReference{APIGroup: ptr.To("hello.example.com"), Kind: "Hello", Name: "h"}
		}, popul: true},
		{name: "claim kind of another group is a populator", claim: func(c *v1.PersistentVolumeClaim) {
			c.Spec.DataSourceRef = &v1.TypedObjectReference{APIGroup: ptr.To("example.com"), Kind: PVCKind, Name: "x"}
		}, popul: true},
		{name: "clone of another namespace", claim: func(c *v1.PersistentVolumeClaim) {
			c.Spec.DataSourceRef = &v1.TypedObjectReference{Kind: PVCKind, Name: "src", Namespace: ptr.To("other")}
		}, want: SourceRef{Kind: SourceClone, Namespace: "other", Name: "src"}},
		{name: "snapshot of another namespace", claim: func(c *v1.PersistentVolumeClaim) {
			c.Spec.DataSourceRef = &v1.TypedObjectReference{APIGroup: ptr.To(SnapshotAPIGroup), Kind: SnapshotKind, Name: "snap", Namespace: ptr.To("other")}
		}, want: SourceRef{Kind: SourceSnapshot, Namespace: "other", Name: "snap"}},
		{name: "dataSourceRef naming the claim's own namespace", claim: func(c *v1.PersistentVolumeClaim) {
			c.Spec.DataSourceRef = &v1.TypedObjectReference{Kind: PVCKind, Name: "src", Namespace: ptr.To("ns")}
		}, want: SourceRef{Kind: SourceClone, Namespace: "ns", Name: "src"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			claim := objects.ClaimFor(drv, "dst", "uid-dst", "fast")
			claim.Namespace = "ns"
			tc.claim(claim)
			got, err := ClaimSource(claim)
			switch {
			case tc.popul:
				if !errors.Is(err, ErrExternalPopulator) {
					t.Fatalf("got %v, %v; want the populator error", got, err)
				}
			case tc.wantErr != "":
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, %v; want error with %q", got, err, tc.wantErr)
				}
			case err != nil || got != tc.want:
				t.Fatalf("got %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}

func TestSourceKindsNeedTheirCapability(t *testing.T) {
	none := rpc.ControllerCapabilitySet{}
	all := rpc.ControllerCapabilitySet{csi.ControllerServiceCapability_RPC_CLONE_VOLUME: true, csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT: true}
	if err := CheckSourceCapability(none, SourceClone); err == nil || !strings.Contains(err.Error(), "CLONE_VOLUME") {
		t.Errorf("clone without CLONE_VOLUME: %v", err)
	}
	if err := CheckSourceCapability(none, SourceSnapshot); err == nil || !strings.Contains(err.Error(), "CREATE_DELETE_SNAPSHOT") {
		t.Errorf("restore without CREATE_DELETE_SNAPSHOT: %v", err)
	}
	for _, k := range []SourceKind{SourceNone, SourceClone, SourceSnapshot} {
		if err := CheckSourceCapability(all, k); err != nil {
			t.Errorf("kind %d with every capability: %v", k, err)
		}
	}
}

func TestCloneSourceChecksEverythingUpstreamChecks(t *testing.T) {
	block := v1.PersistentVolumeBlock
	for _, tc := range []struct {
		name    string
		change  func(dst, src *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume)
		wantErr string
	}{
		{name: "valid clone"},
		{name: "source missing", change: func(_, _ *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			return nil, pv
		}, wantErr: "does not exist"},
		{name: "source not bound", change: func(_, src *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			src.Status.Phase = v1.ClaimPending
			return src, pv
		}, wantErr: "must have a status of Bound"},
		{name: "source being deleted", change: func(_, src *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			src.DeletionTimestamp = &metav1.Time{}
			return src, pv
		}, wantErr: "currently being deleted"},
		// Upstream dropped the same-class check: the source's volume must only be the
		// class's driver's.
		{name: "another class of the driver", change: func(_, src *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			src.Spec.StorageClassName = ptr.To("slow")
			return src, pv
		}},
		{name: "source without a class", change: func(_, src *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			src.Spec.StorageClassName = nil
			return src, pv
		}, wantErr: "storageclass cannot be empty"},
		{name: "smaller than the source", change: func(dst, src *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			src.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse("2Gi")
			return src, pv
		}, wantErr: "greater than or equal in size"},
		{name: "source PV missing", change: func(_, src *v1.PersistentVolumeClaim, _ *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			return src, nil
		}, wantErr: "not bound or invalid"},
		{name: "source PV of another driver", change: func(_, src *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			pv.Spec.CSI.Driver = "other.example.com"
			return src, pv
		}, wantErr: "not bound or invalid"},
		{name: "source PV bound to another claim", change: func(_, src *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			pv.Spec.ClaimRef.UID = types.UID("someone-else")
			return src, pv
		}, wantErr: "not bound or invalid"},
		{name: "volume mode differs", change: func(dst, src *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			dst.Spec.VolumeMode = &block
			return src, pv
		}, wantErr: "same volume mode"},
		{name: "both block", change: func(dst, src *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
			dst.Spec.VolumeMode, pv.Spec.VolumeMode = &block, &block
			return src, pv
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dst := objects.ClaimFor(drv, "dst", "uid-dst", "fast")
			dst.Namespace = "ns"
			src, pv := objects.BoundSource(drv)
			if tc.change != nil {
				src, pv = tc.change(dst, src, pv)
			}
			got, err := CloneSource(dst, objects.Class(drv, "fast", nil), src, pv)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, %v; want error with %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got.GetVolume().GetVolumeId() != "vol-src" {
				t.Fatalf("got %v, %v; want a clone of vol-src", got, err)
			}
		})
	}
}

func TestSnapshotSourceChecksReadinessBindingSizeAndVolumeMode(t *testing.T) {
	block := v1.PersistentVolumeBlock
	for _, tc := range []struct {
		name      string
		change    func(dst *v1.PersistentVolumeClaim, snap *snapshotv1.VolumeSnapshot, content *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent
		noPrevent bool
		wantErr   string
	}{
		{name: "valid restore"},
		{name: "not bound", change: func(_ *v1.PersistentVolumeClaim, s *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			s.Status.BoundVolumeSnapshotContentName = nil
			return c
		}, wantErr: "not bound"},
		{name: "content missing", change: func(*v1.PersistentVolumeClaim, *snapshotv1.VolumeSnapshot, *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			return nil
		}, wantErr: "not bound"},
		{name: "content of another snapshot", change: func(_ *v1.PersistentVolumeClaim, _ *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			c.Spec.VolumeSnapshotRef.UID = "other"
			return c
		}, wantErr: "not bound"},
		{name: "content of another driver", change: func(_ *v1.PersistentVolumeClaim, _ *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			c.Spec.Driver = "other.example.com"
			return c
		}, wantErr: "not bound"},
		{name: "not ready", change: func(_ *v1.PersistentVolumeClaim, s *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			s.Status.ReadyToUse = ptr.To(false)
			return c
		}, wantErr: "not Ready"},
		{name: "no handle", change: func(_ *v1.PersistentVolumeClaim, _ *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			c.Status.SnapshotHandle = nil
			return c
		}, wantErr: "handle snap is not available"},
		{name: "request below restore size", change: func(_ *v1.PersistentVolumeClaim, s *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			s.Status.RestoreSize = ptr.To(resource.MustParse("2Gi"))
			return c
		}, wantErr: "less than the size"},
		{name: "being deleted without our finalizer", change: func(_ *v1.PersistentVolumeClaim, s *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			s.DeletionTimestamp = &metav1.Time{}
			return c
		}, wantErr: "being deleted"},
		{name: "being deleted with our finalizer: the restore goes on", change: func(_ *v1.PersistentVolumeClaim, s *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			s.DeletionTimestamp = &metav1.Time{}
			s.Finalizers = []string{SnapshotProtectionFinalizer}
			return c
		}},
		{name: "mode change without annotation", change: func(d *v1.PersistentVolumeClaim, _ *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			d.Spec.VolumeMode = &block
			return c
		}, wantErr: "annotation is not present"},
		{name: "mode change with annotation false", change: func(d *v1.PersistentVolumeClaim, _ *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			d.Spec.VolumeMode = &block
			c.Annotations = map[string]string{annAllowVolumeModeChange: "false"}
			return c
		}, wantErr: "is set to false"},
		{name: "mode change with annotation garbage", change: func(d *v1.PersistentVolumeClaim, _ *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			d.Spec.VolumeMode = &block
			c.Annotations = map[string]string{annAllowVolumeModeChange: "maybe"}
			return c
		}, wantErr: "failed to convert"},
		{name: "mode change allowed by annotation", change: func(d *v1.PersistentVolumeClaim, _ *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			d.Spec.VolumeMode = &block
			c.Annotations = map[string]string{annAllowVolumeModeChange: "true"}
			return c
		}},
		{name: "mode change allowed when not prevented", noPrevent: true, change: func(d *v1.PersistentVolumeClaim, _ *snapshotv1.VolumeSnapshot, c *snapshotv1.VolumeSnapshotContent) *snapshotv1.VolumeSnapshotContent {
			d.Spec.VolumeMode = &block
			return c
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dst := objects.ClaimFor(drv, "dst", "uid-dst", "fast")
			dst.Namespace = "ns"
			dst.Spec.VolumeMode = ptr.To(v1.PersistentVolumeFilesystem)
			snap, content := objects.ReadySnapshot(drv)
			if tc.change != nil {
				content = tc.change(dst, snap, content)
			}
			got, err := SnapshotSource(dst, objects.Class(drv, "fast", nil), snap, content, !tc.noPrevent)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, %v; want error with %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got.GetSnapshot().GetSnapshotId() != "h" {
				t.Fatalf("got %v, %v; want a restore of h", got, err)
			}
		})
	}
}
