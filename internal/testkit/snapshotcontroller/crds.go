package snapshotcontroller

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"path"
	"slices"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"
)

// CRDVersion is the release of github.com/kubernetes-csi/external-snapshotter/client/v8 the
// embedded CRDs (crd/) are copied from.
const CRDVersion = "v8.7.0"

// CRDFiles are the embedded CRDs' file names, in the order of upstream's kustomization.yaml:
// the three VolumeSnapshot CRDs, then the three VolumeGroupSnapshot CRDs.
var CRDFiles = []string{
	"snapshot.storage.k8s.io_volumesnapshotclasses.yaml",
	"snapshot.storage.k8s.io_volumesnapshotcontents.yaml",
	"snapshot.storage.k8s.io_volumesnapshots.yaml",
	"groupsnapshot.storage.k8s.io_volumegroupsnapshotclasses.yaml",
	"groupsnapshot.storage.k8s.io_volumegroupsnapshotcontents.yaml",
	"groupsnapshot.storage.k8s.io_volumegroupsnapshots.yaml",
}

//go:embed crd/*.yaml
var crdFS embed.FS

// fieldManager owns the CRDs' fields InstallCRDs applies.
const fieldManager = "csi-sidecars-tests"

// installTimeout bounds InstallCRDs when ctx has no deadline.
const installTimeout = 60 * time.Second

var crdResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// CRDs returns the six embedded CRDs (see CRDFiles), freshly parsed on each call, so the
// caller may change them.
func CRDs() ([]*unstructured.Unstructured, error) { return crdsOf(CRDFiles) }

func crdsOf(files []string) ([]*unstructured.Unstructured, error) {
	var crds []*unstructured.Unstructured
	for _, name := range files {
		data, err := crdFS.ReadFile(path.Join("crd", name))
		if err != nil {
			return nil, fmt.Errorf("snapshot CRDs: %w", err)
		}
		obj := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(data, &obj.Object); err != nil {
			return nil, fmt.Errorf("snapshot CRDs: parse %s: %w", name, err)
		}
		crds = append(crds, obj)
	}
	return crds, nil
}

// InstallCRDs installs the VolumeSnapshot and VolumeGroupSnapshot CRDs of external-snapshotter
// CRDVersion into the API server of cfg (which must be allowed to write CRDs, e.g. a
// control plane's admin Config) and returns once each is Established and every served,
// not deprecated version of its resource answers a list. It uses server-side apply with force, so calling
// it again, from several tests at once, or over CRDs of another version is fine: the
// result is these CRDs. ctx bounds it; without a deadline it gives up after 60 s.
func InstallCRDs(ctx context.Context, cfg *rest.Config) error { return install(ctx, cfg, CRDFiles) }

// InstallVolumeSnapshotCRDs is InstallCRDs of the three VolumeSnapshot CRDs alone: a
// cluster without VolumeGroupSnapshots, as one installed before they existed.
func InstallVolumeSnapshotCRDs(ctx context.Context, cfg *rest.Config) error {
	return install(ctx, cfg, CRDFiles[:3])
}

func install(ctx context.Context, cfg *rest.Config, files []string) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, installTimeout)
		defer cancel()
	}
	crds, err := crdsOf(files)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("snapshot CRDs: client: %w", err)
	}
	client := dyn.Resource(crdResource)
	for _, crd := range crds {
		if _, err := client.Apply(ctx, crd.GetName(), crd, metav1.ApplyOptions{FieldManager: fieldManager, Force: true}); err != nil {
			return fmt.Errorf("snapshot CRDs: apply %s: %w", crd.GetName(), err)
		}
	}
	for _, crd := range crds {
		if err := waitServed(ctx, dyn, crd); err != nil {
			return err
		}
	}
	return nil
}

// waitServed waits until crd is Established and a list of each of its served versions (but
// deprecated ones) succeeds: Established alone does not promise that the apiserver's handler for the
// resource is in place yet.
func waitServed(ctx context.Context, dyn dynamic.Interface, crd *unstructured.Unstructured) error {
	name := crd.GetName()
	group, _, _ := unstructured.NestedString(crd.Object, "spec", "group")
	plural, _, _ := unstructured.NestedString(crd.Object, "spec", "names", "plural")
	versions, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
	// Deprecated versions (groupsnapshot v1beta1) are served too, but listing them only
	// draws a deprecation warning into the test's log.
	var served []string
	for _, v := range versions {
		v, _ := v.(map[string]any)
		s, _ := v["served"].(bool)
		deprecated, _ := v["deprecated"].(bool)
		if n, _ := v["name"].(string); s && !deprecated && n != "" {
			served = append(served, n)
		}
	}
	if group == "" || plural == "" || len(served) == 0 {
		return fmt.Errorf("snapshot CRDs: %s names no group, plural or served version", name)
	}

	var last error
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		got, err := dyn.Resource(crdResource).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			last = err
			return false, nil
		}
		if !established(got) {
			last = errors.New("not Established yet")
			return false, nil
		}
		for _, version := range served {
			gvr := schema.GroupVersionResource{Group: group, Version: version, Resource: plural}
			if _, err := dyn.Resource(gvr).List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
				last = fmt.Errorf("list %s: %w", gvr, err)
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("snapshot CRDs: %s not served (last: %v): %w", name, last, err)
	}
	return nil
}

func established(crd *unstructured.Unstructured) bool {
	conditions, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
	return slices.ContainsFunc(conditions, func(c any) bool {
		m, _ := c.(map[string]any)
		return m["type"] == "Established" && m["status"] == "True"
	})
}
