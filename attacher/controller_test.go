package attacher

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/csi-sidecars/csi-sidecars/attacher/finalizer"
	"github.com/csi-sidecars/csi-sidecars/attacher/nodeid"
	"github.com/csi-sidecars/csi-sidecars/attacher/volume"
	"github.com/csi-sidecars/csi-sidecars/internal/queuenames"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

var ourFinalizer = finalizer.Name(testDriver)

func TestAttach(t *testing.T) {
	block := corev1.PersistentVolumeBlock
	tests := []struct {
		name    string
		cfg     func(*config)
		objects func(volID string) []runtime.Object
		driver  testdriver.Config
		fault   codes.Code
		// wantError is a substring of status.attachError.message; "" means attached.
		wantError string
		// wantCode is the recorded errorCode; -1 for none.
		wantCode   int32
		noPublish  bool
		checkReq   func(t *testing.T, req *csi.ControllerPublishVolumeRequest)
		wantWrites []string
	}{
		{
			name:    "publishes with the node ID from CSINode, the PV's capability and context, and records attached",
			objects: standard(),
			checkReq: func(t *testing.T, req *csi.ControllerPublishVolumeRequest) {
				if req.NodeId != testNodeID || req.Readonly || req.VolumeContext["k"] != "v" || len(req.Secrets) != 0 {
					t.Errorf("request %v", req)
				}
				m := req.VolumeCapability.GetMount()
				if m == nil || m.FsType != "ext4" || !slices.Equal(m.MountFlags, []string{"noatime"}) ||
					req.VolumeCapability.AccessMode.Mode != csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER {
					t.Errorf("capability %v", req.VolumeCapability)
				}
			},
			wantWrites: []string{"patch persistentvolumes", "patch volumeattachments", "patch volumeattachments/status"},
		},
		{
			name: "falls back to the Node's nodeid annotation without a CSINode",
			objects: func(id string) []runtime.Object {
				return []runtime.Object{newPV("pv", id), newVA("va", "pv"), nodeWithIDs(`{"` + testDriver + `":"from-node"}`)}
			},
			checkReq: wantNodeID("from-node"),
		},
		{
			name: "falls back to the Node's annotation when the CSINode lacks the driver",
			objects: func(id string) []runtime.Object {
				n := newCSINode(testNode, "x")
				n.Spec.Drivers = n.Spec.Drivers[:1]
				return []runtime.Object{newPV("pv", id), newVA("va", "pv"), n, nodeWithIDs(`{"` + testDriver + `":"from-node"}`)}
			},
			checkReq: wantNodeID("from-node"),
		},
		{
			name:      "no node ID anywhere: attach error, no finalizer, no call",
			objects:   func(id string) []runtime.Object { return []runtime.Object{newPV("pv", id), newVA("va", "pv")} },
			wantError: "not found",
			wantCode:  -1,
			noPublish: true,
			// The PV finalizer comes first, as upstream: it is checked before the node.
			wantWrites: []string{"patch persistentvolumes", "patch volumeattachments/status"},
		},
		{
			name:     "readonly PV with PUBLISH_READONLY publishes readonly",
			objects:  standard(func(pv *corev1.PersistentVolume) { pv.Spec.CSI.ReadOnly = true }),
			checkReq: func(t *testing.T, req *csi.ControllerPublishVolumeRequest) { wantTrue(t, "readonly", req.Readonly) },
		},
		{
			name:     "readonly PV without PUBLISH_READONLY publishes read-write",
			cfg:      func(c *config) { c.publishReadOnly = false },
			objects:  standard(func(pv *corev1.PersistentVolume) { pv.Spec.CSI.ReadOnly = true }),
			checkReq: func(t *testing.T, req *csi.ControllerPublishVolumeRequest) { wantTrue(t, "read-write", !req.Readonly) },
		},
		{
			name: "block volume, ReadWriteMany",
			objects: standard(func(pv *corev1.PersistentVolume) {
				pv.Spec.VolumeMode = &block
				pv.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}
			}),
			checkReq: func(t *testing.T, req *csi.ControllerPublishVolumeRequest) {
				wantTrue(t, "block", req.VolumeCapability.GetBlock() != nil)
				wantTrue(t, "multi-node multi-writer", req.VolumeCapability.AccessMode.Mode == csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
			},
		},
		{
			name:    "fsType from --default-fstype when the PV has none",
			cfg:     func(c *config) { c.defaultFSType = "xfs" },
			objects: standard(func(pv *corev1.PersistentVolume) { pv.Spec.CSI.FSType = "" }),
			checkReq: func(t *testing.T, req *csi.ControllerPublishVolumeRequest) {
				wantTrue(t, "xfs", req.VolumeCapability.GetMount().FsType == "xfs")
			},
		},
		{
			name: "ReadWriteOncePod with SINGLE_NODE_MULTI_WRITER is single-node single-writer",
			cfg:  func(c *config) { c.singleNodeMultiWriter = true },
			driver: testdriver.Config{ControllerCapabilities: append(testdriver.DefaultControllerCapabilities(),
				csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER)},
			objects: standard(func(pv *corev1.PersistentVolume) {
				pv.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOncePod}
			}),
			checkReq: func(t *testing.T, req *csi.ControllerPublishVolumeRequest) {
				wantTrue(t, "single writer", req.VolumeCapability.AccessMode.Mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)
			},
		},
		{
			name: "ControllerPublishSecretRef secret goes to the driver",
			objects: func(id string) []runtime.Object {
				objs := standard(withSecretRef)(id)
				return append(objs, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "creds"}, Data: map[string][]byte{"password": []byte("s3cret")}})
			},
			checkReq: func(t *testing.T, req *csi.ControllerPublishVolumeRequest) {
				wantTrue(t, "secret", req.Secrets["password"] == "s3cret")
			},
		},
		{
			name:       "missing secret: attach error before the finalizer",
			objects:    standard(withSecretRef),
			wantError:  `failed to load secret "ns/creds"`,
			wantCode:   -1,
			noPublish:  true,
			wantWrites: []string{"patch persistentvolumes", "patch volumeattachments/status"},
		},
		{
			name: "missing PV: attach error",
			objects: func(string) []runtime.Object {
				return []runtime.Object{newVA("va", "pv"), newCSINode(testNode, testNodeID)}
			},
			wantError:  "not found",
			wantCode:   -1,
			noPublish:  true,
			wantWrites: []string{"patch volumeattachments/status"},
		},
		{
			name: "PV being deleted is refused",
			objects: standard(func(pv *corev1.PersistentVolume) {
				now := metav1.Now()
				pv.DeletionTimestamp = &now
				pv.Finalizers = []string{"kubernetes.io/pv-protection"}
			}),
			wantError:  "is marked for deletion",
			wantCode:   -1,
			noPublish:  true,
			wantWrites: []string{"patch volumeattachments/status"},
		},
		{name: "driver NotFound: errorCode", objects: standard(), fault: codes.NotFound, wantError: "injected", wantCode: int32(codes.NotFound)},
		{name: "driver InvalidArgument", objects: standard(), fault: codes.InvalidArgument, wantError: "injected", wantCode: int32(codes.InvalidArgument)},
		{name: "driver FailedPrecondition", objects: standard(), fault: codes.FailedPrecondition, wantError: "injected", wantCode: int32(codes.FailedPrecondition)},
		{name: "driver Internal", objects: standard(), fault: codes.Internal, wantError: "injected", wantCode: int32(codes.Internal)},
		{name: "driver DeadlineExceeded (may still run)", objects: standard(), fault: codes.DeadlineExceeded, wantError: "injected", wantCode: int32(codes.DeadlineExceeded)},
		{name: "driver Unavailable (may still run)", objects: standard(), fault: codes.Unavailable, wantError: "injected", wantCode: int32(codes.Unavailable)},
		{name: "driver ResourceExhausted (may still run)", objects: standard(), fault: codes.ResourceExhausted, wantError: "injected", wantCode: int32(codes.ResourceExhausted)},
		{name: "driver Aborted (operation pending)", objects: standard(), fault: codes.Aborted, wantError: "injected", wantCode: int32(codes.Aborted)},
		{
			name:      "without MutableCSINodeAllocatableCount no errorCode is recorded",
			cfg:       func(c *config) { c.errorCodes = false },
			objects:   standard(),
			fault:     codes.NotFound,
			wantError: "injected",
			wantCode:  -1,
		},
		{
			name: "inline volume spec",
			objects: func(id string) []runtime.Object {
				va := newVA("va", "", func(va *storagev1.VolumeAttachment) {
					va.Spec.Source = storagev1.VolumeAttachmentSource{InlineVolumeSpec: &newPV("", id, withMountOptions).Spec}
				})
				return []runtime.Object{va, newCSINode(testNode, testNodeID)}
			},
			checkReq:   wantNodeID(testNodeID),
			wantWrites: []string{"patch volumeattachments", "patch volumeattachments/status"},
		},
		{
			name: "inline volume spec without CSI source: attach error",
			objects: func(id string) []runtime.Object {
				va := newVA("va", "", func(va *storagev1.VolumeAttachment) {
					va.Spec.Source = storagev1.VolumeAttachmentSource{InlineVolumeSpec: &corev1.PersistentVolumeSpec{}}
				})
				return []runtime.Object{va, newCSINode(testNode, testNodeID)}
			},
			wantError: "nil CSI source",
			wantCode:  -1,
			noPublish: true,
		},
		{
			name: "already attached: nothing to do",
			objects: func(id string) []runtime.Object {
				return []runtime.Object{newPV("pv", id), newVA("va", "pv", attachedWith(ourFinalizer)), newCSINode(testNode, testNodeID)}
			},
			noPublish:  true,
			wantWrites: []string{},
		},
		{
			name: "VolumeAttachment of another driver is ignored",
			objects: func(id string) []runtime.Object {
				return []runtime.Object{newPV("pv", id), newVA("va", "pv", func(va *storagev1.VolumeAttachment) { va.Spec.Attacher = "other" }), newCSINode(testNode, testNodeID)}
			},
			noPublish:  true,
			wantWrites: []string{},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := defaultConfig()
			if tc.cfg != nil {
				tc.cfg(&cfg)
			}
			backend, volID := newBackendWithVolume(t, tc.driver)
			f := newFixture(t, cfg, backend, tc.objects(volID)...)
			if tc.fault != codes.OK {
				if err := backend.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerPublishVolume, Code: tc.fault}); err != nil {
					t.Fatal(err)
				}
			}

			err := f.sync("va")

			va := f.va("va")
			publishes, _ := f.csi.counts()
			if tc.noPublish != (publishes == 0) {
				t.Errorf("publish calls %d, want none: %v", publishes, tc.noPublish)
			}
			switch {
			case va.Spec.Attacher != testDriver:
				if err != nil {
					t.Errorf("sync error %v", err)
				}
			case tc.wantError == "" && !tc.noPublish:
				if err != nil || !va.Status.Attached || va.Status.AttachmentMetadata[testdriver.PublishContextDevicePath] == "" {
					t.Errorf("sync error %v, status %+v; want attached with metadata", err, va.Status)
				}
				if !finalizer.Has(va.Finalizers, ourFinalizer) || va.Annotations[nodeid.Annotation] != f.csi.lastPublish().NodeId {
					t.Errorf("finalizers %v, annotations %v", va.Finalizers, va.Annotations)
				}
				if pvName := va.Spec.Source.PersistentVolumeName; pvName != nil && !finalizer.Has(f.pv(*pvName).Finalizers, ourFinalizer) {
					t.Errorf("PV finalizers %v, want %s", f.pv(*pvName).Finalizers, ourFinalizer)
				}
				if tc.checkReq != nil {
					tc.checkReq(t, f.csi.lastPublish())
				}
			case tc.wantError != "":
				if err == nil {
					t.Errorf("sync returned nil, want an error (requeue)")
				}
				ae := va.Status.AttachError
				if ae == nil || !strings.Contains(ae.Message, tc.wantError) || va.Status.Attached {
					t.Fatalf("status %+v, want attachError containing %q", va.Status, tc.wantError)
				}
				if got := codeOf(ae); got != tc.wantCode {
					t.Errorf("errorCode %d, want %d", got, tc.wantCode)
				}
				if tc.noPublish && finalizer.Has(va.Finalizers, ourFinalizer) {
					t.Errorf("finalizer added although nothing was published")
				}
			}
			if tc.wantWrites != nil && !slices.Equal(f.writes(), tc.wantWrites) && !(len(tc.wantWrites) == 0 && len(f.writes()) == 0) {
				t.Errorf("API writes %q, want %q", f.writes(), tc.wantWrites)
			}
		})
	}
}

func TestDetach(t *testing.T) {
	tests := []struct {
		name       string
		va         *storagev1.VolumeAttachment
		noCSINode  bool
		fault      codes.Code
		wantCall   bool
		wantNodeID string
		wantErr    bool
		wantWrites []string
		check      func(t *testing.T, va *storagev1.VolumeAttachment)
	}{
		{
			name:       "unpublishes and removes the last finalizer in one write",
			va:         newVA("va", "pv", attachedWith(ourFinalizer), deleting),
			wantCall:   true,
			wantNodeID: testNodeID,
			wantWrites: []string{"patch volumeattachments"},
			check: func(t *testing.T, va *storagev1.VolumeAttachment) {
				wantTrue(t, "finalizer removed", len(va.Finalizers) == 0)
			},
		},
		{
			name:       "with another finalizer left, removes ours first, then writes attached=false",
			va:         newVA("va", "pv", attachedWith("other/finalizer", ourFinalizer), deleting),
			wantCall:   true,
			wantNodeID: testNodeID,
			wantWrites: []string{"patch volumeattachments", "patch volumeattachments/status"},
			check: func(t *testing.T, va *storagev1.VolumeAttachment) {
				wantTrue(t, "only the other finalizer left", slices.Equal(va.Finalizers, []string{"other/finalizer"}))
				wantTrue(t, "detached, metadata cleared", !va.Status.Attached && va.Status.AttachmentMetadata == nil)
			},
		},
		{
			name:       "a stale detachError is cleared when the VolumeAttachment stays",
			va:         newVA("va", "pv", attachedWith("other/finalizer", ourFinalizer), deleting, withDetachError),
			wantCall:   true,
			wantNodeID: testNodeID,
			wantWrites: []string{"patch volumeattachments", "patch volumeattachments/status"},
			check: func(t *testing.T, va *storagev1.VolumeAttachment) {
				wantTrue(t, "detachError cleared", va.Status.DetachError == nil)
				wantTrue(t, "only the other finalizer left, detached", slices.Equal(va.Finalizers, []string{"other/finalizer"}) && !va.Status.Attached)
			},
		},
		{
			name: "a stale detachError is cleared also when attached was already false",
			va: newVA("va", "pv", attachedWith("other/finalizer", ourFinalizer), deleting, withDetachError, func(va *storagev1.VolumeAttachment) {
				va.Status.Attached = false
				va.Status.AttachmentMetadata = nil
			}),
			wantCall:   true,
			wantNodeID: testNodeID,
			wantWrites: []string{"patch volumeattachments", "patch volumeattachments/status"},
			check: func(t *testing.T, va *storagev1.VolumeAttachment) {
				wantTrue(t, "detachError cleared", va.Status.DetachError == nil)
				wantTrue(t, "only the other finalizer left", slices.Equal(va.Finalizers, []string{"other/finalizer"}))
			},
		},
		{
			name:       "with a stale detachError and the last finalizer, the finalizer removal is the only write",
			va:         newVA("va", "pv", attachedWith(ourFinalizer), deleting, withDetachError),
			wantCall:   true,
			wantNodeID: testNodeID,
			wantWrites: []string{"patch volumeattachments"},
			check: func(t *testing.T, va *storagev1.VolumeAttachment) {
				wantTrue(t, "finalizer removed", len(va.Finalizers) == 0)
			},
		},
		{
			name: "node ID from the annotation when the CSINode is gone",
			va: newVA("va", "pv", attachedWith(ourFinalizer), deleting, func(va *storagev1.VolumeAttachment) {
				va.Annotations[nodeid.Annotation] = "recorded-id"
			}),
			noCSINode:  true,
			wantCall:   true,
			wantNodeID: "recorded-id",
		},
		{
			name:       "driver error keeps the finalizer and records detachError without a code",
			va:         newVA("va", "pv", attachedWith(ourFinalizer), deleting),
			fault:      codes.Internal,
			wantCall:   true,
			wantNodeID: testNodeID,
			wantErr:    true,
			wantWrites: []string{"patch volumeattachments/status"},
			check: func(t *testing.T, va *storagev1.VolumeAttachment) {
				de := va.Status.DetachError
				wantTrue(t, "detachError", de != nil && strings.Contains(de.Message, "injected") && de.ErrorCode == nil)
				wantTrue(t, "finalizer kept, still attached", finalizer.Has(va.Finalizers, ourFinalizer) && va.Status.Attached)
			},
		},
		{
			name:       "without our finalizer there is nothing to detach",
			va:         newVA("va", "pv", deleting, func(va *storagev1.VolumeAttachment) { va.Finalizers = []string{"other/finalizer"} }),
			wantWrites: []string{},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			backend, volID := newBackendWithVolume(t)
			objs := []runtime.Object{newPV("pv", volID, func(pv *corev1.PersistentVolume) { pv.Finalizers = []string{ourFinalizer} }), tc.va}
			if !tc.noCSINode {
				objs = append(objs, newCSINode(testNode, testNodeID))
			}
			f := newFixture(t, defaultConfig(), backend, objs...)
			publishDirectly(t, f, volID, tc.wantNodeID)
			if tc.fault != codes.OK {
				if err := backend.InjectFault(testdriver.Fault{Method: testdriver.MethodControllerUnpublishVolume, Code: tc.fault}); err != nil {
					t.Fatal(err)
				}
			}

			err := f.sync("va")

			if tc.wantErr != (err != nil) {
				t.Errorf("sync error %v, want one: %v", err, tc.wantErr)
			}
			_, unpublishes := f.csi.counts()
			if tc.wantCall != (unpublishes == 1) {
				t.Fatalf("unpublish calls %d, want one: %v", unpublishes, tc.wantCall)
			}
			if tc.wantCall {
				if got := f.csi.unpublishes[0].NodeId; got != tc.wantNodeID {
					t.Errorf("unpublished from node %q, want %q", got, tc.wantNodeID)
				}
				v, _ := backend.Volume(volID)
				if _, still := v.Published[tc.wantNodeID]; still != tc.wantErr {
					t.Errorf("volume still published: %v", still)
				}
			}
			if tc.wantWrites != nil && !(slices.Equal(f.writes(), tc.wantWrites) || len(tc.wantWrites)+len(f.writes()) == 0) {
				t.Errorf("API writes %q, want %q", f.writes(), tc.wantWrites)
			}
			if tc.check != nil {
				tc.check(t, f.va("va"))
			}
		})
	}
}

// A detach that stops between its two writes (the status write fails, or the process dies
// there) has already removed the finalizer: neither a retry nor a new process unpublishes
// the volume again. With the status written first, the finalizer would still be there and
// the next sync would call ControllerUnpublishVolume a second time.
func TestDetachStoppedBetweenWritesDoesNotUnpublishAgain(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	objs := []runtime.Object{
		newPV("pv", volID, withFinalizer),
		newVA("va", "pv", attachedWith("other/finalizer", ourFinalizer), deleting),
		newCSINode(testNode, testNodeID),
	}
	f := newFixture(t, defaultConfig(), backend, objs...)
	publishDirectly(t, f, volID, testNodeID)
	f.kube.PrependReactor("patch", "volumeattachments", failStatusOnce())

	if err := f.sync("va"); err == nil {
		t.Fatal("sync returned nil, want the status write's error (requeue)")
	}
	if got, want := f.writes(), []string{"patch volumeattachments", "patch volumeattachments/status"}; !slices.Equal(got, want) {
		t.Fatalf("API writes %q, want %q: the finalizer first, then the (failed) status", got, want)
	}
	stored := f.va("va")
	if finalizer.Has(stored.Finalizers, ourFinalizer) {
		t.Fatalf("finalizers %v after the failed status write, want ours removed", stored.Finalizers)
	}

	// The same controller retries once its cache shows the write.
	f.waitForCache("va", func(va *storagev1.VolumeAttachment) bool { return !finalizer.Has(va.Finalizers, ourFinalizer) })
	if err := f.sync("va"); err != nil {
		t.Errorf("retry: %v", err)
	}
	// A new process starts from what the API server holds.
	restarted := newFixture(t, defaultConfig(), backend, f.pv("pv"), stored, newCSINode(testNode, testNodeID))
	if err := restarted.sync("va"); err != nil {
		t.Errorf("sync after a restart: %v", err)
	}

	if n := countCalls(backend.Journal(), testdriver.MethodControllerUnpublishVolume); n != 1 {
		t.Errorf("%d ControllerUnpublishVolume calls, want 1", n)
	}
	if v, _ := backend.Volume(volID); len(v.Published) != 0 {
		t.Errorf("driver: still published to %v", v.Published)
	}
}

// A conflict (or any failed write) before the CSI call makes no call and is retried; the
// retry attaches.
func TestConflictOnPatchIsRetried(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	f := newFixture(t, defaultConfig(), backend, standard()(volID)...)
	f.failWrites("volumeattachments", 1, apierrors.NewConflict(schema.GroupResource{Group: "storage.k8s.io", Resource: "volumeattachments"}, "va", nil))

	if err := f.sync("va"); err == nil {
		t.Fatal("sync returned nil after a conflict, want an error (requeue)")
	}
	if p, _ := f.csi.counts(); p != 0 {
		t.Errorf("%d publish calls after the finalizer could not be written, want 0", p)
	}
	if err := f.sync("va"); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if va := f.va("va"); !va.Status.Attached || !finalizer.Has(va.Finalizers, ourFinalizer) {
		t.Errorf("after the retry: status %+v, finalizers %v", va.Status, va.Finalizers)
	}
}

// A failed status write after a successful publish is retried: the publish is repeated
// (drivers must be idempotent) and the status written then.
func TestFailedStatusWriteIsRetried(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	f := newFixture(t, defaultConfig(), backend, standard()(volID)...)
	f.kube.PrependReactor("patch", "volumeattachments", failStatusOnce())
	if err := f.sync("va"); err == nil {
		t.Fatal("sync returned nil, want the status write's error")
	}
	f.waitForCache("va", func(va *storagev1.VolumeAttachment) bool { return finalizer.Has(va.Finalizers, ourFinalizer) })
	if err := f.sync("va"); err != nil {
		t.Fatal(err)
	}
	if !f.va("va").Status.Attached {
		t.Error("not attached after the retry")
	}
}

// Attach then delete, through the caches as the workers see them: finalizers come and go on
// the VolumeAttachment, and the PV's goes once the PV is deleted and unused.
func TestAttachDetachLifecycle(t *testing.T) {
	backend, volID := newBackendWithVolume(t)
	f := newFixture(t, defaultConfig(), backend, standard()(volID)...)
	if err := f.sync("va"); err != nil {
		t.Fatal(err)
	}
	f.waitForCache("va", func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached })
	if v, _ := backend.Volume(volID); !v.Published[testNodeID] && len(v.Published) != 1 {
		t.Fatalf("driver: volume published to %v", v.Published)
	}

	va := f.va("va")
	deleting(va)
	if _, err := f.kube.StorageV1().VolumeAttachments().Update(context.Background(), va, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	f.waitForCache("va", func(va *storagev1.VolumeAttachment) bool { return va.DeletionTimestamp != nil })
	if err := f.sync("va"); err != nil {
		t.Fatal(err)
	}
	if va := f.va("va"); len(va.Finalizers) != 0 {
		t.Errorf("finalizers %v after detach", va.Finalizers)
	}
	if v, _ := backend.Volume(volID); len(v.Published) != 0 {
		t.Errorf("driver: still published to %v", v.Published)
	}

	// The fake clientset does not delete on finalizer removal; the API server would.
	if err := f.kube.StorageV1().VolumeAttachments().Delete(context.Background(), "va", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	pv := f.pv("pv")
	now := metav1.Now()
	pv.DeletionTimestamp = &now
	if _, err := f.kube.CoreV1().PersistentVolumes().Update(context.Background(), pv, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "PV queued", func() bool { return f.ctrl.pvQueue.Len() > 0 })
	waitFor(t, "VA gone from cache", func() bool { _, err := f.ctrl.vaLister.Get("va"); return apierrors.IsNotFound(err) })
	waitFor(t, "PV deleting in cache", func() bool { pv, err := f.ctrl.pvLister.Get("pv"); return err == nil && pv.DeletionTimestamp != nil })
	if err := f.ctrl.pvFinalizers.Sync("pv"); err != nil {
		t.Fatal(err)
	}
	if fin := f.pv("pv").Finalizers; finalizer.Has(fin, ourFinalizer) {
		t.Errorf("PV finalizers %v, want ours removed", fin)
	}
}

func TestPVFinalizer(t *testing.T) {
	now := metav1.Now()
	gcePD := func(pv *corev1.PersistentVolume) {
		pv.Spec.CSI = nil
		pv.Spec.GCEPersistentDisk = &corev1.GCEPersistentDiskVolumeSource{PDName: "disk"}
	}
	tests := []struct {
		name     string
		pv       *corev1.PersistentVolume
		vas      []runtime.Object
		wantKept bool
	}{
		{name: "PV being deleted and unused: removed", pv: newPV("pv", "h", withFinalizer, func(pv *corev1.PersistentVolume) { pv.DeletionTimestamp = &now })},
		{name: "PV being deleted but still used by a VolumeAttachment: kept", pv: newPV("pv", "h", withFinalizer, func(pv *corev1.PersistentVolume) { pv.DeletionTimestamp = &now }), vas: []runtime.Object{newVA("va", "pv")}, wantKept: true},
		{name: "PV in use and not being deleted: kept", pv: newPV("pv", "h", withFinalizer), wantKept: true},
		{name: "in-tree PV not migrated to this driver (rollback): removed", pv: newPV("pv", "h", withFinalizer, gcePD)},
		{name: "in-tree PV migrated to this driver: kept", pv: newPV("pv", "h", withFinalizer, gcePD, func(pv *corev1.PersistentVolume) {
			pv.Annotations = map[string]string{volume.MigratedToAnnotation: testDriver}
		}), wantKept: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			backend, _ := newBackendWithVolume(t)
			f := newFixture(t, defaultConfig(), backend, append(tc.vas, tc.pv)...)
			if err := f.ctrl.pvFinalizers.Sync("pv"); err != nil {
				t.Fatal(err)
			}
			if kept := finalizer.Has(f.pv("pv").Finalizers, ourFinalizer); kept != tc.wantKept {
				t.Errorf("finalizer kept: %v, want %v", kept, tc.wantKept)
			}
		})
	}
}

// A migrated in-tree PV is published with the translated handle, and its translated
// capability.
func TestMigratedInTreePV(t *testing.T) {
	const gcePDDriver = "pd.csi.storage.gke.io"
	cfg := defaultConfig()
	cfg.driver = gcePDDriver
	backend, _ := newBackendWithVolume(t)
	pv := newPV("pv", "", func(pv *corev1.PersistentVolume) {
		pv.Spec.CSI = nil
		pv.Spec.GCEPersistentDisk = &corev1.GCEPersistentDiskVolumeSource{PDName: "disk-1", FSType: "ext4"}
		pv.Annotations = map[string]string{volume.MigratedToAnnotation: gcePDDriver}
	})
	va := newVA("va", "pv", func(va *storagev1.VolumeAttachment) { va.Spec.Attacher = gcePDDriver })
	node := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: testNode}, Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: gcePDDriver, NodeID: "projects/p/zones/z/instances/node-1"}}}}
	f := newFixture(t, cfg, backend, pv, va, node)

	_ = f.sync("va") // the test driver does not know the disk: NotFound
	req := f.csi.lastPublish()
	if req == nil || !strings.HasSuffix(req.VolumeId, "/disks/disk-1") || req.VolumeCapability.GetMount().GetFsType() != "ext4" {
		t.Fatalf("publish request %v, want the translated handle of disk-1", req)
	}
	if !finalizer.Has(f.pv("pv").Finalizers, finalizer.Name(gcePDDriver)) {
		t.Errorf("PV finalizers %v", f.pv("pv").Finalizers)
	}
}

// Drivers without PUBLISH_UNPUBLISH_VOLUME get the trivial handler: attached at once, no
// finalizer, no CSI call; deletion is left alone.
func TestTrivialHandler(t *testing.T) {
	cfg := defaultConfig()
	cfg.trivial = true
	backend, volID := newBackendWithVolume(t)
	f := newFixture(t, cfg, backend, standard()(volID)...)
	if err := f.sync("va"); err != nil {
		t.Fatal(err)
	}
	va := f.va("va")
	if !va.Status.Attached || len(va.Finalizers) != 0 {
		t.Errorf("status %+v finalizers %v; want attached, no finalizer", va.Status, va.Finalizers)
	}
	if p, u := f.csi.counts(); p+u != 0 {
		t.Errorf("%d CSI calls, want none", p+u)
	}
	if got := f.writes(); !slices.Equal(got, []string{"patch volumeattachments/status"}) {
		t.Errorf("writes %q", got)
	}
	f.waitForCache("va", func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached })
	if err := f.sync("va"); err != nil || len(f.writes()) != 0 {
		t.Errorf("second sync: err %v, writes %q; want nothing", err, f.writes())
	}
	if f.ctrl.pvQueue != nil {
		t.Error("trivial handler watches PVs")
	}
}

// The queues report client-go's workqueue metrics under upstream's names (dashboards
// select on them), the attach queue under the name of upstream's one VolumeAttachment
// queue and the detach queue under a new one; the trivial handler has neither a detach
// nor a PV queue.
func TestQueueNames(t *testing.T) {
	for _, tc := range []struct {
		name    string
		trivial bool
		want    []string
	}{
		{name: "publishing driver", want: []string{"csi-attacher-va", "csi-attacher-va-detach", "csi-attacher-pv"}},
		{name: "trivial handler", trivial: true, want: []string{"csi-attacher-va"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			names := &queuenames.Recorder{}
			cfg := defaultConfig()
			cfg.trivial = tc.trivial
			cfg.queueMetrics = names
			backend, _ := newBackendWithVolume(t)
			newFixture(t, cfg, backend)
			if got := names.Names(); !slices.Equal(got, tc.want) {
				t.Errorf("queues %q, want %q", got, tc.want)
			}
		})
	}
}

// Helpers.

// standard is a PV for the volume with context and mount options, its VolumeAttachment and
// a CSINode.
func standard(mutate ...func(*corev1.PersistentVolume)) func(string) []runtime.Object {
	return func(id string) []runtime.Object {
		pv := newPV("pv", id, append([]func(*corev1.PersistentVolume){withMountOptions}, mutate...)...)
		return []runtime.Object{pv, newVA("va", "pv"), newCSINode(testNode, testNodeID)}
	}
}

func withMountOptions(pv *corev1.PersistentVolume) {
	pv.Spec.MountOptions = []string{"noatime"}
	pv.Spec.CSI.VolumeAttributes = map[string]string{"k": "v"}
}

func withSecretRef(pv *corev1.PersistentVolume) {
	pv.Spec.CSI.ControllerPublishSecretRef = &corev1.SecretReference{Namespace: "ns", Name: "creds"}
}

func withFinalizer(pv *corev1.PersistentVolume) { pv.Finalizers = []string{ourFinalizer} }

func nodeWithIDs(annotation string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: testNode, Annotations: map[string]string{nodeid.NodesAnnotation: annotation}}}
}

func wantNodeID(id string) func(*testing.T, *csi.ControllerPublishVolumeRequest) {
	return func(t *testing.T, req *csi.ControllerPublishVolumeRequest) {
		if req.NodeId != id {
			t.Errorf("node ID %q, want %q", req.NodeId, id)
		}
	}
}

func wantTrue(t *testing.T, what string, ok bool) {
	t.Helper()
	if !ok {
		t.Errorf("want %s", what)
	}
}

func codeOf(ve *storagev1.VolumeError) int32 {
	if ve.ErrorCode == nil {
		return -1
	}
	return *ve.ErrorCode
}

func publishDirectly(t *testing.T, f *fixture, volID, nodeID string) {
	t.Helper()
	if nodeID == "" {
		return
	}
	_, err := f.csi.ControllerClient.ControllerPublishVolume(context.Background(), &csi.ControllerPublishVolumeRequest{
		VolumeId: volID, NodeId: nodeID,
		VolumeCapability: &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}},
	})
	if err != nil {
		t.Fatal(err)
	}
}

// A sync reads the newer of the cached copy and this controller's own last write
// (lifecycle.OwnWrites): while the cache is still behind a write that settled the
// VolumeAttachment, a sync of the stale copy neither calls the driver nor writes (upstream
// publishes, or unpublishes, again). The fake clientset keeps no resourceVersions, so the
// written copies are handed to the controller as its patches would; the e2e tests count
// the calls and writes against a real API server.
func TestASyncOfACopyOlderThanTheOwnWriteDoesNothing(t *testing.T) {
	backend, id := newBackendWithVolume(t)
	pending := newVA("va", "pv", func(va *storagev1.VolumeAttachment) { va.ResourceVersion = "5" })
	f := newFixture(t, defaultConfig(), backend, newPV("pv", id), newCSINode(testNode, testNodeID), pending)

	// Attached by our write at 9; the cache still shows 5, pending.
	attached := pending.DeepCopy()
	attachedWith(finalizer.Name(testDriver))(attached)
	attached.ResourceVersion = "9"
	f.ctrl.vas.Wrote(attached)
	if err := f.sync("va"); err != nil {
		t.Fatal(err)
	}
	if p, u := f.csi.counts(); p+u != 0 || len(f.writes()) != 0 {
		t.Errorf("sync of the copy behind the own write: %d publishes, %d unpublishes, writes %v; want none", p, u, f.writes())
	}

	// Deleted, and detached by our writes up to 12; the cache shows the deletion at 10,
	// finalizer still on.
	deleted := attached.DeepCopy()
	deleting(deleted)
	deleted.ResourceVersion = "10"
	if err := f.vaStore.Update(deleted); err != nil {
		t.Fatal(err)
	}
	detached := deleted.DeepCopy()
	detached.Finalizers = []string{"other"} // another controller's keeps it
	detached.Status = storagev1.VolumeAttachmentStatus{}
	detached.ResourceVersion = "12"
	f.ctrl.vas.Wrote(detached)
	if err := f.sync("va"); err != nil {
		t.Fatal(err)
	}
	if p, u := f.csi.counts(); p+u != 0 || len(f.writes()) != 0 {
		t.Errorf("sync of the deletion behind the own detach: %d publishes, %d unpublishes, writes %v; want none", p, u, f.writes())
	}

	// Another writer's copy newer than ours (13: our finalizer back, attached) is what the
	// sync decides on.
	newer := deleted.DeepCopy()
	newer.ResourceVersion = "13"
	if err := f.vaStore.Update(newer); err != nil {
		t.Fatal(err)
	}
	if err := f.sync("va"); err != nil {
		t.Fatal(err)
	}
	if _, u := f.csi.counts(); u != 1 {
		t.Errorf("sync of a copy newer than the own write: %d unpublishes, want 1", u)
	}
}
