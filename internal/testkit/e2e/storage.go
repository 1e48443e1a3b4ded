package e2e

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
)

// Storage plays, for the sidecars' end-to-end runs, the parts of a cluster that are not
// there: users creating and growing claims, kube-controller-manager binding them and
// creating VolumeAttachments, and the kubelet registering the node's CSI driver.
type Storage struct {
	Kube      kubernetes.Interface
	Namespace string // of the claims
	Class     string // StorageClass of the driver (Immediate binding, Delete, expandable)
	Node      string
	Driver    string
	// Parameters are the StorageClass's parameters (none when nil).
	Parameters map[string]string
}

// SetUp creates the StorageClass, and a Node with its CSINode naming nodeID (what the
// kubelet registers); the namespace must exist.
func (s Storage) SetUp(ctx context.Context, nodeID string) error {
	driver := s.Driver
	sc := &storagev1.StorageClass{
		ObjectMeta:           metav1.ObjectMeta{Name: s.Class},
		Provisioner:          driver,
		ReclaimPolicy:        ptr.To(corev1.PersistentVolumeReclaimDelete),
		VolumeBindingMode:    ptr.To(storagev1.VolumeBindingImmediate),
		AllowVolumeExpansion: ptr.To(true),
		Parameters:           s.Parameters,
	}
	if _, err := s.Kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("creating StorageClass: %w", err)
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: s.Node,
		Annotations: map[string]string{"csi.volume.kubernetes.io/nodeid": fmt.Sprintf(`{%q:%q}`, driver, nodeID)}}}
	n, err := s.Kube.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("creating Node: %w", err)
	}
	csiNode := &storagev1.CSINode{
		ObjectMeta: metav1.ObjectMeta{Name: s.Node, OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: n.Name, UID: n.UID}}},
		Spec:       storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: driver, NodeID: nodeID}}},
	}
	if _, err := s.Kube.StorageV1().CSINodes().Create(ctx, csiNode, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("creating CSINode: %w", err)
	}
	return nil
}

// CreateClaim creates a 1Gi PVC of the class, annotated as the PV controller would for the
// provisioner.
func (s Storage) CreateClaim(ctx context.Context, name string) error {
	driver := s.Driver
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: s.Namespace, Annotations: map[string]string{
			"volume.kubernetes.io/storage-provisioner":      driver,
			"volume.beta.kubernetes.io/storage-provisioner": driver,
		}},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: ptr.To(s.Class),
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	_, err := s.Kube.CoreV1().PersistentVolumeClaims(s.Namespace).Create(ctx, pvc, metav1.CreateOptions{})
	return err
}

// Bind binds a provisioned PV and its claim, as kube-controller-manager's PV controller would.
func (s Storage) Bind(ctx context.Context, pv *corev1.PersistentVolume) error {
	kube := s.Kube
	if pv.Spec.ClaimRef == nil {
		return fmt.Errorf("PV %s has no claimRef", pv.Name)
	}
	// The provisioner may still be writing the claim (its provisioning record goes after
	// the PV is saved): read it again on a conflict, as controllers do.
	claims := kube.CoreV1().PersistentVolumeClaims(pv.Spec.ClaimRef.Namespace)
	var pvc *corev1.PersistentVolumeClaim
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		current, err := claims.Get(ctx, pv.Spec.ClaimRef.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		current.Spec.VolumeName = pv.Name
		pvc, err = claims.Update(ctx, current, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("binding claim %s: %w", pv.Spec.ClaimRef.Name, err)
	}
	pvc.Status.Phase = corev1.ClaimBound
	pvc.Status.AccessModes = pv.Spec.AccessModes
	pvc.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: pv.Spec.Capacity[corev1.ResourceStorage]}
	if _, err = kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("binding claim %s status: %w", pvc.Name, err)
	}
	pv.Status.Phase = corev1.VolumeBound
	if _, err = kube.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("binding PV %s status: %w", pv.Name, err)
	}
	return nil
}

// CreateAttachment creates the VolumeAttachment kube-controller-manager's attach-detach
// controller would create for a Pod using pv on the node.
func (s Storage) CreateAttachment(ctx context.Context, pv string) error {
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: s.Node + "-" + pv},
		Spec: storagev1.VolumeAttachmentSpec{
			Attacher: s.Driver,
			NodeName: s.Node,
			Source:   storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(pv)},
		},
	}
	_, err := s.Kube.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{})
	return err
}

// Expand raises a claim's request, as a user would.
func (s Storage) Expand(ctx context.Context, name, size string) error {
	claims := s.Kube.CoreV1().PersistentVolumeClaims(s.Namespace)
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pvc, err := claims.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse(size)
		_, err = claims.Update(ctx, pvc, metav1.UpdateOptions{})
		return err
	})
}

// Provisioned lists the PVs of the driver.
func (s Storage) Provisioned(ctx context.Context) ([]corev1.PersistentVolume, error) {
	list, err := s.Kube.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	var out []corev1.PersistentVolume
	for _, pv := range list.Items {
		if pv.Spec.CSI != nil && pv.Spec.CSI.Driver == s.Driver {
			out = append(out, pv)
		}
	}
	return out, nil
}

// BindAll binds every provisioned PV that is not bound yet.
func (s Storage) BindAll(ctx context.Context) (int, error) {
	pvs, err := s.Provisioned(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for i := range pvs {
		if pvs[i].Status.Phase == corev1.VolumeBound {
			continue
		}
		if err := s.Bind(ctx, &pvs[i]); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}

// Attached counts the driver's VolumeAttachments whose status says attached.
func (s Storage) Attached(ctx context.Context) (int, error) {
	list, err := s.Kube.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	if err != nil {
		return 0, err
	}
	n := 0
	for _, va := range list.Items {
		if va.Spec.Attacher == s.Driver && va.Status.Attached {
			n++
		}
	}
	return n, nil
}

// Expanded counts the driver's PVs whose capacity is at least size.
func (s Storage) Expanded(ctx context.Context, size string) (int, error) {
	pvs, err := s.Provisioned(ctx)
	if err != nil {
		return 0, err
	}
	want := resource.MustParse(size)
	n := 0
	for _, pv := range pvs {
		if c := pv.Spec.Capacity[corev1.ResourceStorage]; c.Cmp(want) >= 0 {
			n++
		}
	}
	return n, nil
}

// SetUpStorage is the scenario's Storage, set up: a StorageClass named after the namespace
// with params (none when nil), and a Node named after it whose CSINode is the scenario
// driver's node.
func (s *Scenario) SetUpStorage(params map[string]string) Storage {
	s.T.Helper()
	store := Storage{Kube: s.Client, Namespace: s.Namespace, Class: s.Namespace, Node: s.Namespace + "-node", Driver: s.Driver.DriverName(), Parameters: params}
	if err := store.SetUp(context.Background(), s.Driver.NodeID()); err != nil {
		s.T.Fatal(err)
	}
	return store
}
