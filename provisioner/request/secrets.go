package request

import (
	"context"
	"fmt"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// csiParameterPrefix starts the StorageClass parameters that are the sidecar's, not the
// driver's: the secrets' and the request's own (fstype, the claim's name).
const csiParameterPrefix = "csi.storage.k8s.io/"

// SecretParams names the StorageClass parameters of one kind of secret.
type SecretParams struct {
	Kind string
	// The deprecated keys (csiProvisionerSecretName, ...) are read but, not being prefixed,
	// still passed to the driver, as upstream.
	DeprecatedNameKey, DeprecatedNamespaceKey string
	NameKey, NamespaceKey                     string
}

var (
	ProvisionerSecret = SecretParams{Kind: "Provisioner",
		DeprecatedNameKey: "csiProvisionerSecretName", DeprecatedNamespaceKey: "csiProvisionerSecretNamespace",
		NameKey: csiParameterPrefix + "provisioner-secret-name", NamespaceKey: csiParameterPrefix + "provisioner-secret-namespace"}
	ControllerPublishSecret = SecretParams{Kind: "ControllerPublish",
		DeprecatedNameKey: "csiControllerPublishSecretName", DeprecatedNamespaceKey: "csiControllerPublishSecretNamespace",
		NameKey: csiParameterPrefix + "controller-publish-secret-name", NamespaceKey: csiParameterPrefix + "controller-publish-secret-namespace"}
	NodeStageSecret = SecretParams{Kind: "NodeStage",
		DeprecatedNameKey: "csiNodeStageSecretName", DeprecatedNamespaceKey: "csiNodeStageSecretNamespace",
		NameKey: csiParameterPrefix + "node-stage-secret-name", NamespaceKey: csiParameterPrefix + "node-stage-secret-namespace"}
	NodePublishSecret = SecretParams{Kind: "NodePublish",
		DeprecatedNameKey: "csiNodePublishSecretName", DeprecatedNamespaceKey: "csiNodePublishSecretNamespace",
		NameKey: csiParameterPrefix + "node-publish-secret-name", NamespaceKey: csiParameterPrefix + "node-publish-secret-namespace"}
	ControllerExpandSecret = SecretParams{Kind: "ControllerExpand",
		NameKey: csiParameterPrefix + "controller-expand-secret-name", NamespaceKey: csiParameterPrefix + "controller-expand-secret-namespace"}
	NodeExpandSecret = SecretParams{Kind: "NodeExpand",
		NameKey: csiParameterPrefix + "node-expand-secret-name", NamespaceKey: csiParameterPrefix + "node-expand-secret-namespace"}
	// ControllerModifySecret is for the resizer's ControllerModifyVolume: the
	// PersistentVolume names it in annotations (a CSI source has no field for it).
	ControllerModifySecret = SecretParams{Kind: "ControllerModify",
		NameKey: csiParameterPrefix + "controller-modify-secret-name", NamespaceKey: csiParameterPrefix + "controller-modify-secret-namespace"}
	// DefaultSecret applies to every kind that names no secret of its own.
	DefaultSecret = SecretParams{Kind: "Default",
		NameKey: csiParameterPrefix + "secret-name", NamespaceKey: csiParameterPrefix + "secret-namespace"}
)

// allSecrets lists every kind of secret but the default.
func allSecrets() []SecretParams {
	return []SecretParams{ProvisionerSecret, ControllerPublishSecret, NodeStageSecret, NodePublishSecret, ControllerExpandSecret, NodeExpandSecret, ControllerModifySecret}
}

// SecretRefs are the secrets of one volume, resolved from the StorageClass.
type SecretRefs struct {
	Provisioner, ControllerPublish, NodeStage, NodePublish, ControllerExpand, NodeExpand, ControllerModify *v1.SecretReference
}

// ResolveSecretRefs resolves every kind of secret for a volume.
func ResolveSecretRefs(params map[string]string, pvName string, claim *v1.PersistentVolumeClaim) (SecretRefs, error) {
	var refs SecretRefs
	for _, s := range []struct {
		params SecretParams
		into   **v1.SecretReference
	}{
		{ProvisionerSecret, &refs.Provisioner},
		{ControllerPublishSecret, &refs.ControllerPublish},
		{NodeStageSecret, &refs.NodeStage},
		{NodePublishSecret, &refs.NodePublish},
		{ControllerExpandSecret, &refs.ControllerExpand},
		{NodeExpandSecret, &refs.NodeExpand},
		{ControllerModifySecret, &refs.ControllerModify},
	} {
		ref, err := SecretReference(s.params, params, pvName, claim)
		if err != nil {
			return refs, err
		}
		*s.into = ref
	}
	return refs, nil
}

// secretTemplates reads the name and namespace templates of one kind of secret: both or
// neither must be given, each by one key only.
func secretTemplates(s SecretParams, params map[string]string) (name, namespace string, err error) {
	names, namespaces := 0, 0
	for _, k := range []string{s.DeprecatedNameKey, s.NameKey} {
		if v, ok := params[k]; ok && k != "" {
			name = v
			names++
		}
	}
	for _, k := range []string{s.DeprecatedNamespaceKey, s.NamespaceKey} {
		if v, ok := params[k]; ok && k != "" {
			namespace = v
			namespaces++
		}
	}
	switch {
	case names > 1 || namespaces > 1:
		return "", "", fmt.Errorf("%s secrets specified in parameters with both \"csi\" and %q keys", s.Kind, csiParameterPrefix)
	case names != namespaces:
		return "", "", fmt.Errorf("either name and namespace for %s secrets specified, Both must be specified", s.Kind)
	case names == 1 && (name == "" || namespace == ""):
		return "", "", fmt.Errorf("%s secrets specified in parameters but value of either namespace or name is empty", s.Kind)
	}
	return name, namespace, nil
}

// Template tokens. The namespace may only use what the claim's user does not control
// (the PersistentVolume's name, the claim's namespace); the name may also use the claim's
// name and annotations.
const (
	tokenPVName       = "pv.name"
	tokenPVCName      = "pvc.name"
	tokenPVCNamespace = "pvc.namespace"
)

// namespaceTemplateValues are the tokens a secret namespace template may use.
func namespaceTemplateValues(pvName string, claim *v1.PersistentVolumeClaim) map[string]string {
	values := map[string]string{tokenPVName: pvName}
	if claim != nil {
		values[tokenPVCNamespace] = claim.Namespace
	}
	return values
}

// nameTemplateValues are the tokens a secret name template may use.
func nameTemplateValues(pvName string, claim *v1.PersistentVolumeClaim) map[string]string {
	values := namespaceTemplateValues(pvName, claim)
	if claim != nil {
		values[tokenPVCName] = claim.Name
		for k, v := range claim.Annotations {
			values["pvc.annotations['"+k+"']"] = v
		}
	}
	return values
}

// SecretReference resolves one kind of secret (or the default secret when the kind names
// none) into a reference; nil when the StorageClass names no secret. The secret is not
// read here.
func SecretReference(s SecretParams, params map[string]string, pvName string, claim *v1.PersistentVolumeClaim) (*v1.SecretReference, error) {
	nameTmpl, nsTmpl, err := secretTemplates(s, params)
	if err != nil {
		return nil, fmt.Errorf("failed to get name and namespace template from params: %w", err)
	}
	if nameTmpl == "" && nsTmpl == "" {
		if nameTmpl, nsTmpl, err = secretTemplates(DefaultSecret, params); err != nil {
			return nil, fmt.Errorf("failed to get default name and namespace template from params: %w", err)
		}
	}
	if nameTmpl == "" && nsTmpl == "" {
		return nil, nil
	}
	namespace, err := resolveTemplate(nsTmpl, namespaceTemplateValues(pvName, claim))
	if err != nil {
		return nil, fmt.Errorf("error resolving value %q: %w", nsTmpl, err)
	}
	if len(validation.IsDNS1123Label(namespace)) > 0 {
		return nil, fmt.Errorf("%q resolved to %q which is not a valid namespace name", nsTmpl, namespace)
	}
	name, err := resolveTemplate(nameTmpl, nameTemplateValues(pvName, claim))
	if err != nil {
		return nil, fmt.Errorf("error resolving value %q: %w", nameTmpl, err)
	}
	if len(validation.IsDNS1123Subdomain(name)) > 0 {
		return nil, fmt.Errorf("%q resolved to %q which is not a valid secret name", nameTmpl, name)
	}
	return &v1.SecretReference{Name: name, Namespace: namespace}, nil
}

// resolveTemplate replaces each ${token} in template by its value. A token that is not in
// values, an unterminated "${", or a "$" followed by a name (shell style, $pvc) is an error,
// so a template can never reach anything but the tokens it was given. Any other "$" is
// kept as it is.
func resolveTemplate(template string, values map[string]string) (string, error) {
	var out strings.Builder
	var invalid []string
	for i := 0; i < len(template); i++ {
		c := template[i]
		if c != '$' || i+1 == len(template) {
			out.WriteByte(c)
			continue
		}
		next := template[i+1]
		switch {
		case next == '{':
			end := strings.IndexByte(template[i+2:], '}')
			if end < 0 {
				return "", fmt.Errorf("unterminated token in %q", template)
			}
			token := template[i+2 : i+2+end]
			v, ok := values[token]
			if !ok {
				invalid = append(invalid, token)
			}
			out.WriteString(v)
			i += 2 + end
		case isShellNameByte(next):
			// os.Expand, which upstream uses, would read this as a variable: refuse it
			// rather than guess.
			j := i + 1
			for j < len(template) && isShellNameByte(template[j]) {
				j++
			}
			invalid = append(invalid, template[i+1:j])
			i = j - 1
		default:
			out.WriteByte(c)
		}
	}
	if len(invalid) > 0 {
		slices.Sort(invalid)
		return "", fmt.Errorf("invalid tokens: %q", slices.Compact(invalid))
	}
	return out.String(), nil
}

func isShellNameByte(c byte) bool {
	return c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

// ReadSecret returns the data of a secret as the strings CSI calls take; nil for no
// reference. Secret values are never logged.
func ReadSecret(ctx context.Context, kube kubernetes.Interface, ref *v1.SecretReference) (map[string]string, error) {
	if ref == nil {
		return nil, nil
	}
	secret, err := lifecycle.GetSecret(ctx, kube, ref.Namespace, ref.Name)
	if err != nil {
		return nil, fmt.Errorf("error getting secret %s in namespace %s: %w", ref.Name, ref.Namespace, err)
	}
	data := make(map[string]string, len(secret.Data))
	for k, v := range secret.Data {
		data[k] = string(v)
	}
	return data, nil
}

// Annotations on the PersistentVolume naming the secret DeleteVolume needs, so deletion
// works even when the StorageClass is gone (upstream's names).
const (
	AnnDeletionSecretName      = "volume.kubernetes.io/provisioner-deletion-secret-name"
	AnnDeletionSecretNamespace = "volume.kubernetes.io/provisioner-deletion-secret-namespace"
	// The secret of ControllerModifyVolume, which the resizer reads from the
	// PersistentVolume; set only when the StorageClass names one (upstream's names).
	AnnModifySecretName      = "volume.kubernetes.io/controller-modify-secret-name"
	AnnModifySecretNamespace = "volume.kubernetes.io/controller-modify-secret-namespace"
)
