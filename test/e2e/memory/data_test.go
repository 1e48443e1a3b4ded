package memory

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/client-go/kubernetes"
	volumehelpers "k8s.io/component-helpers/storage/volume"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// Rate limits and concurrency of the client that writes the data set: fast enough that
// 25,000 requests take about a minute on the local API server.
const (
	setupQPS     = 500
	setupBurst   = 1000
	setupWorkers = 48
	// podsPerNode spreads the Pods (and so the VolumeAttachments) over nodes as a cluster
	// would; the node count is fixed when the data set is made, from its largest size.
	podsPerNode = 100
	// runLabel marks every object of a data set, for the clean-up.
	runLabel = "memory.csi-sidecars.io/run"
)

// dataset is the steady state of a cluster using a CSI driver: bound claims and their
// PersistentVolumes (as our provisioner and the PV controller leave them), VolumeAttachments
// attached (as our attacher leaves them, the volumes published in the test driver), and two
// Running Pods per claim (as the kubelet leaves them). Nothing in it needs doing: a sidecar
// started on it only lists, watches and resyncs.
type dataset struct {
	s      *e2e.Scenario
	kube   kubernetes.Interface // rate limits of a fast client
	csi    csi.ControllerClient
	driver string
	class  string
	nodes  []string
	pairs  int // claims created so far; each has a PV, a VolumeAttachment and two Pods
	// handles are the claims' volume handles in the driver, by claim (maxPairs of them).
	handles []string
}

// newDataset creates the StorageClass, the nodes (with their CSINodes) and the namespace's
// default ServiceAccount (Pod admission needs it; no controller creates it here). maxPairs
// fixes the node count.
func newDataset(ctx context.Context, s *e2e.Scenario, maxPairs int) (*dataset, error) {
	cfg := s.CP.Config()
	cfg.QPS, cfg.Burst = setupQPS, setupBurst
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	srv, err := s.Driver.Serve(filepath.Join(s.Dir, "setup.sock"))
	if err != nil {
		return nil, err
	}
	s.T.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(srv.Endpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	s.T.Cleanup(func() { conn.Close() })
	d := &dataset{s: s, kube: kube, csi: csi.NewControllerClient(conn), driver: s.Driver.DriverName(), class: s.Namespace,
		handles: make([]string, maxPairs)}
	s.T.Cleanup(func() { d.cleanUp() })

	labels := map[string]string{runLabel: s.Namespace}
	sc := &storagev1.StorageClass{
		ObjectMeta:           metav1.ObjectMeta{Name: d.class, Labels: labels},
		Provisioner:          d.driver,
		Parameters:           map[string]string{"type": "ssd", "csi.storage.k8s.io/fstype": "ext4"},
		ReclaimPolicy:        ptr.To(corev1.PersistentVolumeReclaimDelete),
		VolumeBindingMode:    ptr.To(storagev1.VolumeBindingImmediate),
		AllowVolumeExpansion: ptr.To(true),
	}
	if _, err := kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("creating StorageClass: %w", err)
	}
	if _, err := kube.CoreV1().ServiceAccounts(s.Namespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("creating ServiceAccount: %w", err)
	}
	n := max(1, (2*maxPairs+podsPerNode-1)/podsPerNode)
	for i := range n {
		name := fmt.Sprintf("%s-node-%03d", s.Namespace, i)
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{
			Name: name,
			Labels: map[string]string{runLabel: s.Namespace, "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
				"kubernetes.io/arch": "amd64", "topology.kubernetes.io/zone": fmt.Sprintf("zone-%d", i%3)},
			Annotations: map[string]string{"csi.volume.kubernetes.io/nodeid": fmt.Sprintf(`{%q:%q}`, d.driver, nodeID(name))},
		}}
		if _, err := kube.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
			return nil, fmt.Errorf("creating Node: %w", err)
		}
		csiNode := &storagev1.CSINode{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
			Spec:       storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: d.driver, NodeID: nodeID(name)}}},
		}
		if _, err := kube.StorageV1().CSINodes().Create(ctx, csiNode, metav1.CreateOptions{}); err != nil {
			return nil, fmt.Errorf("creating CSINode: %w", err)
		}
		d.nodes = append(d.nodes, name)
	}
	return d, nil
}

func nodeID(node string) string { return node + "-id" }

// objects is the number of objects a data set of pairs claims holds: per claim a PVC, a PV,
// a VolumeAttachment and two Pods.
func objects(pairs int) int { return 5 * pairs }

// grow creates claims d.pairs..to-1 with everything that goes with them, concurrently.
func (d *dataset) grow(ctx context.Context, to int) error {
	if err := inParallel(ctx, d.pairs, to, "claim", d.pair); err != nil {
		return err
	}
	d.pairs = to
	return nil
}

// inParallel calls make(ctx, i) for i in from..to-1 on setupWorkers workers, and stops at
// the first error, which it returns naming the item (what i).
func inParallel(ctx context.Context, from, to int, what string, make func(context.Context, int) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	next := atomic.Int64{}
	next.Store(int64(from))
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	for range setupWorkers {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= to || ctx.Err() != nil {
					return
				}
				if err := make(ctx, i); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("%s %d: %w", what, i, err)
					}
					mu.Unlock()
					cancel()
					return
				}
			}
		})
	}
	wg.Wait()
	return firstErr
}

// pair creates claim i: the PVC, the volume in the driver published to the node, the PV,
// the VolumeAttachment and two Pods, each with the status the controllers and the kubelet
// would have written.
func (d *dataset) pair(ctx context.Context, i int) error {
	ns := d.s.Namespace
	node := d.nodes[(2*i/podsPerNode)%len(d.nodes)]
	app := fmt.Sprintf("app-%05d", i)
	labels := map[string]string{runLabel: ns, "app.kubernetes.io/name": app, "app.kubernetes.io/part-of": "memory-bench"}
	pvName := "pvc-" + string(uuid.NewUUID())
	oneGi := resource.MustParse("1Gi")
	rwo := []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}
	created := metav1.NewTime(time.Now().Add(-24 * time.Hour).Truncate(time.Second))

	// The claim, bound by the PV controller.
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{
			Name: "data-" + app, Namespace: ns, Labels: labels,
			Annotations: map[string]string{
				"pv.kubernetes.io/bind-completed":               "yes",
				"pv.kubernetes.io/bound-by-controller":          "yes",
				"volume.beta.kubernetes.io/storage-provisioner": d.driver,
				"volume.kubernetes.io/storage-provisioner":      d.driver,
			},
			Finalizers: []string{"kubernetes.io/pvc-protection"},
		},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      rwo,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: oneGi}},
			StorageClassName: ptr.To(d.class),
			VolumeMode:       ptr.To(corev1.PersistentVolumeFilesystem),
			VolumeName:       pvName,
		},
	}
	pvc, err := d.kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("creating PVC: %w", err)
	}
	pvc.Status = corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound, AccessModes: rwo, Capacity: corev1.ResourceList{corev1.ResourceStorage: oneGi}}
	if pvc, err = d.kube.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("PVC status: %w", err)
	}

	// The volume in the driver, published to the node, as the provisioner and the attacher
	// left it (so the attacher's ListVolumes reconciler finds nothing to repair).
	capability := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	vol, err := d.csi.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name: pvName, CapacityRange: &csi.CapacityRange{RequiredBytes: oneGi.Value()},
		VolumeCapabilities: []*csi.VolumeCapability{capability}, Parameters: map[string]string{"type": "ssd"},
	})
	if err != nil {
		return fmt.Errorf("CreateVolume: %w", err)
	}
	handle := vol.GetVolume().GetVolumeId()
	d.handles[i] = handle // each worker writes its own claims' entries
	pub, err := d.csi.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: handle, NodeId: nodeID(node), VolumeCapability: capability})
	if err != nil {
		return fmt.Errorf("ControllerPublishVolume: %w", err)
	}

	// The PV as the provisioner created it, with the attacher's finalizer.
	attributes := map[string]string{"storage.kubernetes.io/csiProvisionerIdentity": "1752000000000-1234-" + d.driver}
	for k, v := range vol.GetVolume().GetVolumeContext() {
		attributes[k] = v
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name:   pvName,
			Labels: map[string]string{runLabel: ns},
			Annotations: map[string]string{
				volumehelpers.AnnDynamicallyProvisioned:                      d.driver,
				"volume.kubernetes.io/provisioner-deletion-secret-name":      "",
				"volume.kubernetes.io/provisioner-deletion-secret-namespace": "",
			},
			Finalizers: []string{"kubernetes.io/pv-protection", volumehelpers.PVDeletionProtectionFinalizer, attacherFinalizer(d.driver)},
		},
		Spec: corev1.PersistentVolumeSpec{
			AccessModes: rwo,
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: oneGi},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: d.driver, VolumeHandle: handle, FSType: "ext4", VolumeAttributes: attributes,
			}},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			StorageClassName:              d.class,
			VolumeMode:                    ptr.To(corev1.PersistentVolumeFilesystem),
			ClaimRef: &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: ns, Name: pvc.Name,
				UID: pvc.UID, ResourceVersion: pvc.ResourceVersion},
		},
	}
	if pv, err = d.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("creating PV: %w", err)
	}
	pv.Status = corev1.PersistentVolumeStatus{Phase: corev1.VolumeBound, LastPhaseTransitionTime: &created}
	if _, err = d.kube.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("PV status: %w", err)
	}

	// The VolumeAttachment, named as the attach/detach controller names it, attached.
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{
			Name:        fmt.Sprintf("csi-%x", sha256.Sum256([]byte(pvName+d.driver+node))),
			Labels:      map[string]string{runLabel: ns},
			Annotations: map[string]string{"csi.alpha.kubernetes.io/node-id": nodeID(node)},
			Finalizers:  []string{attacherFinalizer(d.driver)},
		},
		Spec: storagev1.VolumeAttachmentSpec{
			Attacher: d.driver, NodeName: node,
			Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(pvName)},
		},
	}
	if va, err = d.kube.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("creating VolumeAttachment: %w", err)
	}
	va.Status = storagev1.VolumeAttachmentStatus{Attached: true, AttachmentMetadata: pub.GetPublishContext()}
	if _, err = d.kube.StorageV1().VolumeAttachments().UpdateStatus(ctx, va, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("VolumeAttachment status: %w", err)
	}

	// Two Running Pods of a ReplicaSet using the claim.
	rs := app + "-7d9f8b6c5d"
	rsUID := types.UID(uuid.NewUUID())
	for k := range 2 {
		pod := podOf(ns, fmt.Sprintf("%s-%s", rs, suffix(i, k)), rs, rsUID, app, pvc.Name, node)
		if pod, err = d.kube.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("creating Pod: %w", err)
		}
		pod.Status = runningStatus(pod, node, 2*i+k, created)
		if _, err = d.kube.CoreV1().Pods(ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("Pod status: %w", err)
		}
	}
	return nil
}

func attacherFinalizer(driver string) string {
	return "external-attacher/" + lifecycle.SanitizeName(driver)
}

// suffix is a ReplicaSet Pod's random-looking five-character suffix.
func suffix(i, k int) string {
	const alphabet = "bcdfghjklmnpqrstvwxz2456789"
	h := sha256.Sum256(fmt.Appendf(nil, "%d/%d", i, k))
	out := make([]byte, 5)
	for j := range out {
		out[j] = alphabet[int(h[j])%len(alphabet)]
	}
	return string(out)
}

// podOf is a Deployment's Pod as created by the ReplicaSet controller and scheduled:
// one container with image, ports, probes, resources, a few environment variables,
// security settings and the claim mounted. Admission adds the ServiceAccount token volume,
// tolerations, priority and the QoS class.
func podOf(ns, name, rs string, rsUID types.UID, app, claim, node string) *corev1.Pod {
	probe := func(path string, delay int32) *corev1.Probe {
		return &corev1.Probe{
			ProbeHandler:        corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: path, Port: intstr.FromString("http"), Scheme: corev1.URISchemeHTTP}},
			InitialDelaySeconds: delay, TimeoutSeconds: 1, PeriodSeconds: 10, SuccessThreshold: 1, FailureThreshold: 3,
		}
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: ns,
			Labels: map[string]string{
				runLabel: ns, "app.kubernetes.io/name": app, "app.kubernetes.io/part-of": "memory-bench",
				"app.kubernetes.io/component": "server", "app.kubernetes.io/version": "2.53", "pod-template-hash": "7d9f8b6c5d",
			},
			Annotations: map[string]string{
				"kubectl.kubernetes.io/restartedAt": "2026-07-01T12:00:00Z",
				"prometheus.io/scrape":              "true",
				"prometheus.io/port":                "8080",
				"prometheus.io/path":                "/metrics",
			},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: rs, UID: rsUID,
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}},
		},
		Spec: corev1.PodSpec{
			NodeName:      node,
			SchedulerName: "default-scheduler",
			SecurityContext: &corev1.PodSecurityContext{RunAsUser: ptr.To[int64](1000), RunAsGroup: ptr.To[int64](1000),
				FSGroup: ptr.To[int64](1000), RunAsNonRoot: ptr.To(true), SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
			TerminationGracePeriodSeconds: ptr.To[int64](30),
			Containers: []corev1.Container{{
				Name:            "server",
				Image:           "registry.k8s.io/e2e-test-images/agnhost:2.53",
				ImagePullPolicy: corev1.PullIfNotPresent,
				Args:            []string{"netexec", "--http-port=8080", "--udp-port=-1"},
				Ports:           []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
				Env: []corev1.EnvVar{
					{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "metadata.name"}}},
					{Name: "POD_NAMESPACE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "metadata.namespace"}}},
					{Name: "LOG_LEVEL", Value: "info"},
					{Name: "DATA_DIR", Value: "/data"},
				},
				Resources: corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("128Mi")},
					Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("500m"), corev1.ResourceMemory: resource.MustParse("256Mi")},
				},
				VolumeMounts:             []corev1.VolumeMount{{Name: "data", MountPath: "/data"}},
				LivenessProbe:            probe("/healthz", 10),
				ReadinessProbe:           probe("/readyz", 5),
				TerminationMessagePath:   corev1.TerminationMessagePathDefault,
				TerminationMessagePolicy: corev1.TerminationMessageReadFile,
				SecurityContext: &corev1.SecurityContext{AllowPrivilegeEscalation: ptr.To(false), ReadOnlyRootFilesystem: ptr.To(true),
					Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}},
			}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}},
		},
	}
}

// runningStatus is what the kubelet reports for a Pod whose container runs and is ready.
func runningStatus(pod *corev1.Pod, node string, n int, at metav1.Time) corev1.PodStatus {
	nodeIndex := 0
	fmt.Sscanf(node[len(node)-3:], "%d", &nodeIndex)
	hostIP := fmt.Sprintf("10.0.%d.%d", nodeIndex/250, nodeIndex%250+1)
	podIP := fmt.Sprintf("10.%d.%d.%d", 64+nodeIndex/250, nodeIndex%250, n%250+2)
	started := metav1.NewTime(at.Add(4 * time.Second))
	cond := func(t corev1.PodConditionType, when metav1.Time) corev1.PodCondition {
		return corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: when}
	}
	c := pod.Spec.Containers[0]
	mounts := make([]corev1.VolumeMountStatus, 0, len(c.VolumeMounts))
	for _, m := range c.VolumeMounts {
		mounts = append(mounts, corev1.VolumeMountStatus{Name: m.Name, MountPath: m.MountPath, ReadOnly: m.ReadOnly,
			RecursiveReadOnly: m.RecursiveReadOnly})
	}
	containerID := sha256.Sum256([]byte(pod.Namespace + "/" + pod.Name))
	return corev1.PodStatus{
		Phase: corev1.PodRunning,
		Conditions: []corev1.PodCondition{
			cond(corev1.PodReadyToStartContainers, started),
			cond(corev1.PodInitialized, at),
			cond(corev1.PodReady, metav1.NewTime(started.Add(6*time.Second))),
			cond(corev1.ContainersReady, metav1.NewTime(started.Add(6*time.Second))),
			cond(corev1.PodScheduled, at),
		},
		HostIP:    hostIP,
		HostIPs:   []corev1.HostIP{{IP: hostIP}},
		PodIP:     podIP,
		PodIPs:    []corev1.PodIP{{IP: podIP}},
		StartTime: &at,
		QOSClass:  corev1.PodQOSBurstable,
		ContainerStatuses: []corev1.ContainerStatus{{
			Name:               c.Name,
			State:              corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: started}},
			Ready:              true,
			RestartCount:       0,
			Image:              c.Image,
			ImageID:            "registry.k8s.io/e2e-test-images/agnhost@sha256:99c6b4bb4a1e1df3f0b3752168c89358794d02258ebebc26bf21c29399011a85",
			ContainerID:        fmt.Sprintf("containerd://%x", containerID),
			Started:            ptr.To(true),
			AllocatedResources: c.Resources.Requests,
			Resources:          &corev1.ResourceRequirements{Requests: c.Resources.Requests, Limits: c.Resources.Limits},
			VolumeMounts:       mounts,
			User:               &corev1.ContainerUser{Linux: &corev1.LinuxContainerUser{UID: 1000, GID: 1000, SupplementalGroups: []int64{1000}}},
		}},
	}
}

// podJSONSize is the size of one of the data set's Pods as JSON, as the API server stores
// and serves it (managed fields included).
func (d *dataset) podJSONSize(ctx context.Context) (int, error) {
	list, err := d.kube.CoreV1().Pods(d.s.Namespace).List(ctx, metav1.ListOptions{Limit: 1})
	if err != nil || len(list.Items) == 0 {
		return 0, err
	}
	raw, err := json.Marshal(list.Items[0])
	return len(raw), err
}

// cleanUp removes the data set: finalizers first (no controller runs to remove them), then
// the objects, so a later run on the same control plane starts from an empty cluster.
func (d *dataset) cleanUp() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns := d.s.Namespace
	sel := metav1.ListOptions{LabelSelector: runLabel + "=" + ns}
	noFinalizers := []byte(`{"metadata":{"finalizers":null}}`)
	var jobs []func() error
	if pvcs, err := d.kube.CoreV1().PersistentVolumeClaims(ns).List(ctx, sel); err == nil {
		for _, o := range pvcs.Items {
			jobs = append(jobs, func() error {
				if _, err := d.kube.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, o.Name, types.MergePatchType, noFinalizers, metav1.PatchOptions{}); err != nil {
					return err
				}
				return d.kube.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, o.Name, metav1.DeleteOptions{})
			})
		}
	}
	if pvs, err := d.kube.CoreV1().PersistentVolumes().List(ctx, sel); err == nil {
		for _, o := range pvs.Items {
			jobs = append(jobs, func() error {
				if _, err := d.kube.CoreV1().PersistentVolumes().Patch(ctx, o.Name, types.MergePatchType, noFinalizers, metav1.PatchOptions{}); err != nil {
					return err
				}
				return d.kube.CoreV1().PersistentVolumes().Delete(ctx, o.Name, metav1.DeleteOptions{})
			})
		}
	}
	if vas, err := d.kube.StorageV1().VolumeAttachments().List(ctx, sel); err == nil {
		for _, o := range vas.Items {
			jobs = append(jobs, func() error {
				if _, err := d.kube.StorageV1().VolumeAttachments().Patch(ctx, o.Name, types.MergePatchType, noFinalizers, metav1.PatchOptions{}); err != nil {
					return err
				}
				return d.kube.StorageV1().VolumeAttachments().Delete(ctx, o.Name, metav1.DeleteOptions{})
			})
		}
	}
	work := make(chan func() error)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for range setupWorkers {
		wg.Go(func() {
			for f := range work {
				if err := f(); err != nil && !apierrors.IsNotFound(err) {
					failed.Add(1)
				}
			}
		})
	}
	for _, f := range jobs {
		work <- f
	}
	close(work)
	wg.Wait()
	// Pods go at once with a zero grace period (no kubelet confirms them).
	if err := d.kube.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}, sel); err != nil {
		failed.Add(1)
	}
	for _, del := range []func() error{
		func() error {
			return d.kube.StorageV1().CSINodes().DeleteCollection(ctx, metav1.DeleteOptions{}, sel)
		},
		func() error { return d.kube.CoreV1().Nodes().DeleteCollection(ctx, metav1.DeleteOptions{}, sel) },
		func() error {
			return d.kube.StorageV1().StorageClasses().DeleteCollection(ctx, metav1.DeleteOptions{}, sel)
		},
	} {
		if err := del(); err != nil {
			failed.Add(1)
		}
	}
	if n := failed.Load(); n > 0 {
		d.s.T.Logf("clean-up: %d requests failed; later runs on this control plane see leftovers", n)
	}
}
