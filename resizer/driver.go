package resizer

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	"github.com/kubernetes-csi/csi-lib-utils/accessmodes"
	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	csitrans "k8s.io/csi-translation-lib"
	"k8s.io/klog/v2"
)

// expander grows volumes: through the driver's controller, or trivially by handing the
// whole resize to the node.
type expander interface {
	// expand grows pv's volume to at least size bytes and returns the size reached and
	// whether the node must still grow it.
	expand(ctx context.Context, pv *v1.PersistentVolume, size int64) (int64, bool, error)
	// controllerExpands is false for the trivial expander, whose "expansion" is a hand-off.
	controllerExpands() bool
	mode() string
}

// csiExpander calls ControllerExpandVolume.
type csiExpander struct {
	client            csi.ControllerClient
	kube              kubernetes.Interface
	singleNodeMultiWr bool
}

func (*csiExpander) controllerExpands() bool { return true }
func (*csiExpander) mode() string            { return "ControllerExpandVolume" }

func (e *csiExpander) expand(ctx context.Context, pv *v1.PersistentVolume, size int64) (int64, bool, error) {
	spec, migrated, err := csiSpec(ctx, pv)
	if err != nil {
		return 0, false, err
	}
	src := spec.CSI
	if src.VolumeHandle == "" {
		return 0, false, fmt.Errorf("PV %s has no volume handle", pv.Name)
	}
	capability, err := volumeCapability(spec, e.singleNodeMultiWr)
	if err != nil {
		return 0, false, fmt.Errorf("volume capability of PV %s: %w", pv.Name, err)
	}
	secrets, err := readSecret(ctx, e.kube, src.ControllerExpandSecretRef, "controller-expand")
	if err != nil {
		return 0, false, err
	}
	req := &csi.ControllerExpandVolumeRequest{
		VolumeId:         src.VolumeHandle,
		CapacityRange:    &csi.CapacityRange{RequiredBytes: size},
		Secrets:          secrets,
		VolumeCapability: capability,
	}
	logger := klog.FromContext(ctx)
	logger.V(5).Info("ControllerExpandVolume", "request", protosanitizer.StripSecrets(req))
	rsp, err := e.client.ControllerExpandVolume(lifecycle.MarkMigrated(ctx, migrated), req)
	if err != nil {
		return 0, false, err
	}
	reached := rsp.GetCapacityBytes()
	if reached == 0 {
		// A driver that does not say what it reached did what it was asked.
		reached = size
	}
	return reached, rsp.GetNodeExpansionRequired(), nil
}

// csiSpec is the CSI view of a PV the expansion handles (expansionController.handles): its
// own spec, or for an in-tree PV migrated to the driver the spec csi-translation-lib
// translates it to (migrated set), as upstream's csiResizer.Resize does. The PV object
// itself keeps its in-tree source.
func csiSpec(ctx context.Context, pv *v1.PersistentVolume) (spec *v1.PersistentVolumeSpec, migrated bool, err error) {
	if pv.Spec.CSI != nil {
		return &pv.Spec, false, nil
	}
	translated, err := csitrans.New().TranslateInTreePVToCSI(klog.FromContext(ctx), pv)
	if err != nil {
		return nil, false, fmt.Errorf("translating in-tree PV %s to CSI: %w", pv.Name, err)
	}
	if translated.Spec.CSI == nil {
		return nil, false, fmt.Errorf("PV %s translated to no CSI source", pv.Name)
	}
	return &translated.Spec, true, nil
}

// migratedTo is the CSI driver an in-tree PV is migrated to, as csi-translation-lib maps
// in-tree plugins to drivers; "" for a CSI PV or one no driver replaces.
func migratedTo(pv *v1.PersistentVolume) string {
	if pv.Spec.CSI != nil {
		return ""
	}
	tr := csitrans.New()
	plugin, err := tr.GetInTreePluginNameFromSpec(pv, nil)
	if err != nil {
		return ""
	}
	driver, err := tr.GetCSINameFromInTreeName(plugin)
	if err != nil {
		return ""
	}
	return driver
}

// trivialExpander serves drivers that grow volumes only on the node: no controller call,
// the PV takes the new size and the kubelet does the rest.
type trivialExpander struct{}

func (trivialExpander) controllerExpands() bool { return false }
func (trivialExpander) mode() string            { return "node only (trivial resizer)" }

func (trivialExpander) expand(_ context.Context, _ *v1.PersistentVolume, size int64) (int64, bool, error) {
	return size, true, nil
}

// modifier calls ControllerModifyVolume.
type modifier struct {
	client csi.ControllerClient
	kube   kubernetes.Interface
}

func (m *modifier) modify(ctx context.Context, pv *v1.PersistentVolume, params map[string]string) error {
	src := pv.Spec.CSI
	if src == nil || src.VolumeHandle == "" {
		return fmt.Errorf("PV %s is not a CSI volume with a volume handle", pv.Name)
	}
	ref, kind := modifySecretRef(pv)
	secrets, err := readSecret(ctx, m.kube, ref, kind)
	if err != nil {
		return err
	}
	req := &csi.ControllerModifyVolumeRequest{VolumeId: src.VolumeHandle, Secrets: secrets, MutableParameters: params}
	klog.FromContext(ctx).V(5).Info("ControllerModifyVolume", "request", protosanitizer.StripSecrets(req))
	_, err = m.client.ControllerModifyVolume(ctx, req)
	return err
}

// volumeCapability is the CSI capability of a CSI PV (spec.CSI set): block or mount (with
// its file system type and mount options) and the access mode its access modes map to.
func volumeCapability(spec *v1.PersistentVolumeSpec, singleNodeMultiWriter bool) (*csi.VolumeCapability, error) {
	mode, err := accessmodes.ToCSIAccessMode(spec.AccessModes, singleNodeMultiWriter)
	if err != nil {
		return nil, err
	}
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if spec.VolumeMode != nil && *spec.VolumeMode == v1.PersistentVolumeBlock {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		return c, nil
	}
	c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: spec.CSI.FSType, MountFlags: spec.MountOptions}}
	return c, nil
}

// Annotations the provisioner puts on a PV whose StorageClass names a secret for
// ControllerModifyVolume (csi.storage.k8s.io/controller-modify-secret-*), as upstream reads
// them. The secret is not in the CSI source, which has no field for it.
const (
	annModifySecretName      = "volume.kubernetes.io/controller-modify-secret-name"
	annModifySecretNamespace = "volume.kubernetes.io/controller-modify-secret-namespace"
)

// modifySecretRef is the secret ControllerModifyVolume gets, as upstream's
// getModifyCredentials picks it: the one the modify annotations name when both are set,
// else the controller-expand secret of the CSI source (PVs provisioned before modify
// secrets existed were given that one for every controller call), else none. kind names
// it in errors.
func modifySecretRef(pv *v1.PersistentVolume) (ref *v1.SecretReference, kind string) {
	name, ns := pv.Annotations[annModifySecretName], pv.Annotations[annModifySecretNamespace]
	if name != "" && ns != "" {
		return &v1.SecretReference{Namespace: ns, Name: name}, "controller-modify"
	}
	if pv.Spec.CSI == nil {
		return nil, ""
	}
	return pv.Spec.CSI.ControllerExpandSecretRef, "controller-expand"
}

// readSecret reads the secret a PV names for a controller call (kind says which, for the
// error); nil ref, no secrets.
func readSecret(ctx context.Context, kube kubernetes.Interface, ref *v1.SecretReference, kind string) (map[string]string, error) {
	if ref == nil {
		return nil, nil
	}
	s, err := lifecycle.GetSecret(ctx, kube, ref.Namespace, ref.Name)
	if err != nil {
		return nil, fmt.Errorf("reading the %s secret %s/%s: %w", kind, ref.Namespace, ref.Name, err)
	}
	out := make(map[string]string, len(s.Data))
	for k, v := range s.Data {
		out[k] = string(v)
	}
	return out, nil
}

// isInfeasible tells whether the driver refused the request itself: retrying it will not
// help, the user must change it (RecoverVolumeExpansionFailure).
func isInfeasible(err error) bool {
	st, ok := status.FromError(err)
	if !ok {
		return false
	}
	switch st.Code() {
	case codes.InvalidArgument, codes.OutOfRange, codes.NotFound:
		return true
	}
	return false
}

// isInUse tells whether the driver refused because the volume is in use (an offline-only
// driver and a Pod using the PVC).
func isInUse(err error) bool {
	st, ok := status.FromError(err)
	return ok && st.Code() == codes.FailedPrecondition
}
