package snapshotter

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
)

// The class parameters and content annotations that name secrets, upstream's keys.
const (
	paramPrefix = "csi.storage.k8s.io/"

	paramSnapshotterSecretName           = paramPrefix + "snapshotter-secret-name"
	paramSnapshotterSecretNamespace      = paramPrefix + "snapshotter-secret-namespace"
	paramListSecretName                  = paramPrefix + "snapshotter-list-secret-name"
	paramListSecretNamespace             = paramPrefix + "snapshotter-list-secret-namespace"
	paramGroupSnapshotterSecretName      = paramPrefix + "group-snapshotter-secret-name"
	paramGroupSnapshotterSecretNamespace = paramPrefix + "group-snapshotter-secret-namespace"
	paramGroupGetSecretName              = paramPrefix + "group-snapshotter-get-secret-name"
	paramGroupGetSecretNamespace         = paramPrefix + "group-snapshotter-get-secret-namespace"

	// The snapshot-controller copies the snapshotter secret's name onto the content, for
	// CreateSnapshot and DeleteSnapshot.
	annDeletionSecretName      = "snapshot.storage.kubernetes.io/deletion-secret-name"
	annDeletionSecretNamespace = "snapshot.storage.kubernetes.io/deletion-secret-namespace"
	annGroupSecretName         = "groupsnapshot.storage.kubernetes.io/deletion-secret-name"
	annGroupSecretNamespace    = "groupsnapshot.storage.kubernetes.io/deletion-secret-namespace"

	// The parameters --extra-create-metadata adds.
	paramSnapshotName        = paramPrefix + "volumesnapshot/name"
	paramSnapshotNamespace   = paramPrefix + "volumesnapshot/namespace"
	paramContentName         = paramPrefix + "volumesnapshotcontent/name"
	paramGroupSnapshotName   = paramPrefix + "volumegroupsnapshot/name"
	paramGroupSnapshotNS     = paramPrefix + "volumegroupsnapshot/namespace"
	paramGroupContentName    = paramPrefix + "volumegroupsnapshotcontent/name"
	reservedKeysErrorMessage = "found unknown parameter key %q with reserved namespace " + paramPrefix
)

// driverParameters are a class's parameters without the secret keys; any other key in the
// reserved csi.storage.k8s.io/ namespace is an error, as upstream.
func driverParameters(params map[string]string) (map[string]string, error) {
	out := make(map[string]string, len(params))
	for k, v := range params {
		if !strings.HasPrefix(k, paramPrefix) {
			out[k] = v
			continue
		}
		switch k {
		case paramSnapshotterSecretName, paramSnapshotterSecretNamespace, paramListSecretName, paramListSecretNamespace,
			paramGroupSnapshotterSecretName, paramGroupSnapshotterSecretNamespace, paramGroupGetSecretName, paramGroupGetSecretNamespace:
		default:
			return nil, fmt.Errorf(reservedKeysErrorMessage, k)
		}
	}
	return out, nil
}

// secretRef resolves the secret a class names with nameKey and namespaceKey, whose values
// may hold ${<kind>content.name} (the only token upstream resolves for the sidecar); nil
// when the class names none.
func secretRef(params map[string]string, nameKey, namespaceKey, contentToken, contentName string) (*v1.SecretReference, error) {
	nameTemplate, hasName := params[nameKey]
	nsTemplate, hasNS := params[namespaceKey]
	switch {
	case !hasName && !hasNS:
		return nil, nil
	case hasName != hasNS:
		return nil, fmt.Errorf("the class names only one of %s and %s: both must be given", nameKey, namespaceKey)
	case nameTemplate == "" || nsTemplate == "":
		return nil, fmt.Errorf("the class gives %s or %s empty", nameKey, namespaceKey)
	}
	vars := map[string]string{contentToken: contentName}
	ns, err := expand(nsTemplate, vars)
	if err != nil {
		return nil, err
	}
	if len(validation.IsDNS1123Label(ns)) > 0 {
		return nil, fmt.Errorf("%q (from %q) is not a valid namespace name", ns, nsTemplate)
	}
	name, err := expand(nameTemplate, vars)
	if err != nil {
		return nil, err
	}
	if len(validation.IsDNS1123Subdomain(name)) > 0 {
		return nil, fmt.Errorf("%q (from %q) is not a valid secret name", name, nameTemplate)
	}
	return &v1.SecretReference{Namespace: ns, Name: name}, nil
}

func expand(template string, vars map[string]string) (string, error) {
	var missing []string
	out := os.Expand(template, func(k string) string {
		v, ok := vars[k]
		if !ok {
			missing = append(missing, k)
		}
		return v
	})
	if len(missing) > 0 {
		return "", fmt.Errorf("%q has tokens that cannot be resolved here: %q", template, missing)
	}
	return out, nil
}

// annotatedSecret is the secret named by a pair of annotations, nil when they name none.
func annotatedSecret(annotations map[string]string, nameKey, namespaceKey string) (*v1.SecretReference, error) {
	name, hasName := annotations[nameKey]
	ns, hasNS := annotations[namespaceKey]
	if !hasName || !hasNS {
		return nil, nil
	}
	if name == "" || ns == "" {
		return nil, fmt.Errorf("annotations %s and %s must both name the secret", nameKey, namespaceKey)
	}
	return &v1.SecretReference{Namespace: ns, Name: name}, nil
}

// credentials reads the secret ref names (nothing for nil). Its values go to the driver
// only; they are never logged.
func credentials(ctx context.Context, kube kubernetes.Interface, ref *v1.SecretReference) (map[string]string, error) {
	if ref == nil {
		return nil, nil
	}
	secret, err := lifecycle.GetSecret(ctx, kube, ref.Namespace, ref.Name)
	if err != nil {
		return nil, fmt.Errorf("reading secret %s/%s: %w", ref.Namespace, ref.Name, err)
	}
	out := make(map[string]string, len(secret.Data))
	for k, v := range secret.Data {
		out[k] = string(v)
	}
	return out, nil
}
