// Package testsidecar is a minimal sidecar for the lifecycle core's end-to-end tests: for
// every labelled ConfigMap it makes one CSI CreateVolume call and records the outcome in an
// annotation, shaped like a real sidecar (informer handler enqueues, workers process). It
// exists so the core's promises can be proven before, and apart from, the real sidecars.
package testsidecar

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

const (
	// WorkLabel marks a ConfigMap as work for the test sidecar.
	WorkLabel = "csi-sidecars.io/test-work"
	// ResultAnnotation is written when the CSI call for a ConfigMap returned: "ok" or the error.
	ResultAnnotation = "csi-sidecars.io/result"
	// VolumePrefix prefixes the volume name derived from the ConfigMap's name.
	VolumePrefix = "vol-"
)

// Sidecar is the test sidecar.
type Sidecar struct {
	name      string
	workers   int
	timeout   time.Duration
	namespace string

	lister corelisters.ConfigMapLister
	queue  *lifecycle.Queue[string]
}

// New returns the test sidecar, named "test".
func New() *Sidecar { return &Sidecar{name: "test"} }

// NewInProcess returns a test sidecar for tests that host several in one process: its own
// name (subcommand, Lease, queue) and namespace, and the flags' defaults.
func NewInProcess(name, namespace string) *Sidecar {
	return &Sidecar{name: name, namespace: namespace, workers: 4, timeout: 60 * time.Second}
}

var _ lifecycle.Sidecar = &Sidecar{}

// Name implements lifecycle.Sidecar.
func (s *Sidecar) Name() string { return s.name }

// AddFlags implements lifecycle.Sidecar.
func (s *Sidecar) AddFlags(fs *pflag.FlagSet) {
	fs.IntVar(&s.workers, "workers", 4, "Number of workers.")
	fs.DurationVar(&s.timeout, "timeout", 60*time.Second, "Timeout of one CSI call.")
	fs.StringVar(&s.namespace, "namespace", "", "Only ConfigMaps in this namespace are work (default: all).")
}

// ValidateFlags implements lifecycle.FlagValidator.
func (s *Sidecar) ValidateFlags() error {
	if s.workers <= 0 {
		return fmt.Errorf("--workers must be positive, got %d", s.workers)
	}
	return nil
}

// LeaseName implements lifecycle.Sidecar.
func (s *Sidecar) LeaseName(driver string) string { return "csi-sidecars-" + s.name + "-" + driver }

// Setup implements lifecycle.Sidecar.
func (s *Sidecar) Setup(env *lifecycle.Env) error {
	s.queue = lifecycle.NewQueue[string](lifecycle.QueueOptions{Name: s.name, RetryStart: 100 * time.Millisecond, RetryMax: 5 * time.Second, Backlog: env.Backlog})
	inf := env.Informers.Core().V1().ConfigMaps()
	s.lister = inf.Lister()
	_, err := inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    s.enqueue,
		UpdateFunc: func(_, obj any) { s.enqueue(obj) },
	})
	return err
}

func (s *Sidecar) enqueue(obj any) {
	cm, ok := obj.(*corev1.ConfigMap)
	if !ok || cm.Labels[WorkLabel] == "" || cm.Annotations[ResultAnnotation] != "" ||
		(s.namespace != "" && cm.Namespace != s.namespace) {
		return
	}
	if key, err := cache.MetaNamespaceKeyFunc(cm); err == nil {
		s.queue.Add(key)
	}
}

// Run implements lifecycle.Sidecar.
func (s *Sidecar) Run(intake context.Context, env *lifecycle.Env) error {
	lifecycle.RunWorkers(intake, s.queue, s.workers, func(key string) error {
		return s.sync(env, key)
	})
	return nil
}

// sync makes the CSI call for one ConfigMap and records its result, both on Ops() (P1).
func (s *Sidecar) sync(env *lifecycle.Env, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	cm, err := s.lister.ConfigMaps(ns).Get(name)
	if apierrors.IsNotFound(err) || (err == nil && cm.Annotations[ResultAnnotation] != "") {
		return nil
	}
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(env.Ops(), s.timeout)
	defer cancel()
	_, callErr := csi.NewControllerClient(env.CSI).CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name:               VolumePrefix + cm.Name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{mountCapability()},
	})
	result := "ok"
	if callErr != nil {
		result = callErr.Error()
	}
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, ResultAnnotation, result)
	if _, err := env.Kube.CoreV1().ConfigMaps(ns).Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("recording the result of %s: %w", key, err)
	}
	klog.FromContext(ctx).V(2).Info("Recorded result", "configMap", key, "result", result)
	return callErr
}

func mountCapability() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}
