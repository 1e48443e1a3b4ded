package request

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
)

func annotatedClaim() *v1.PersistentVolumeClaim {
	return &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{
		Name: "data", Namespace: "team-a", UID: objects.UID,
		Annotations: map[string]string{"example.com/secret": "custom-secret", "evil": "../other"},
	}}
}

func TestSecretReferencesResolveTemplatesWithTheAllowedTokensOnly(t *testing.T) {
	p := ProvisionerSecret
	for _, tc := range []struct {
		name    string
		params  map[string]string
		want    *v1.SecretReference
		wantErr string
	}{
		{name: "no secret", params: map[string]string{"type": "x"}, want: nil},
		{name: "literal", params: map[string]string{p.NameKey: "creds", p.NamespaceKey: "kube-system"},
			want: &v1.SecretReference{Name: "creds", Namespace: "kube-system"}},
		{name: "claim name and namespace", params: map[string]string{p.NameKey: "${pvc.name}-creds", p.NamespaceKey: "${pvc.namespace}"},
			want: &v1.SecretReference{Name: "data-creds", Namespace: "team-a"}},
		{name: "pv name in both", params: map[string]string{p.NameKey: "s-${pv.name}", p.NamespaceKey: "${pv.name}"},
			want: &v1.SecretReference{Name: "s-pvc-1", Namespace: "pvc-1"}},
		{name: "annotation in name", params: map[string]string{p.NameKey: "${pvc.annotations['example.com/secret']}", p.NamespaceKey: "ns"},
			want: &v1.SecretReference{Name: "custom-secret", Namespace: "ns"}},
		{name: "deprecated keys", params: map[string]string{p.DeprecatedNameKey: "old", p.DeprecatedNamespaceKey: "ns"},
			want: &v1.SecretReference{Name: "old", Namespace: "ns"}},
		{name: "default secret applies", params: map[string]string{DefaultSecret.NameKey: "all", DefaultSecret.NamespaceKey: "ns"},
			want: &v1.SecretReference{Name: "all", Namespace: "ns"}},
		{name: "own secret wins over default", params: map[string]string{DefaultSecret.NameKey: "all", DefaultSecret.NamespaceKey: "ns", p.NameKey: "mine", p.NamespaceKey: "ns"},
			want: &v1.SecretReference{Name: "mine", Namespace: "ns"}},
		{name: "claim name not allowed in namespace", params: map[string]string{p.NameKey: "s", p.NamespaceKey: "${pvc.name}"}, wantErr: "invalid tokens"},
		{name: "annotation not allowed in namespace", params: map[string]string{p.NameKey: "s", p.NamespaceKey: "${pvc.annotations['example.com/secret']}"}, wantErr: "invalid tokens"},
		{name: "unknown token", params: map[string]string{p.NameKey: "${pvc.uid}", p.NamespaceKey: "ns"}, wantErr: "invalid tokens"},
		{name: "missing annotation", params: map[string]string{p.NameKey: "${pvc.annotations['nope']}", p.NamespaceKey: "ns"}, wantErr: "invalid tokens"},
		{name: "resolves to an invalid name", params: map[string]string{p.NameKey: "${pvc.annotations['evil']}", p.NamespaceKey: "ns"}, wantErr: "not a valid secret name"},
		{name: "name without namespace", params: map[string]string{p.NameKey: "s"}, wantErr: "Both must be specified"},
		{name: "empty value", params: map[string]string{p.NameKey: "", p.NamespaceKey: "ns"}, wantErr: "value of either namespace or name is empty"},
		{name: "both old and new keys", params: map[string]string{p.NameKey: "a", p.DeprecatedNameKey: "b", p.NamespaceKey: "ns"}, wantErr: "with both"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := SecretReference(p, tc.params, "pvc-1", annotatedClaim())
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("reference (-want +got):\n%s", diff)
			}
		})
	}
}

func TestEveryKindOfSecretIsResolvedIntoItsOwnReference(t *testing.T) {
	params := map[string]string{}
	for _, s := range allSecrets() {
		params[s.NameKey] = strings.ToLower(s.Kind) + "-${pvc.name}"
		params[s.NamespaceKey] = "${pvc.namespace}"
	}
	refs, err := ResolveSecretRefs(params, "pvc-1", annotatedClaim())
	if err != nil {
		t.Fatal(err)
	}
	ref := func(n string) *v1.SecretReference { return &v1.SecretReference{Name: n, Namespace: "team-a"} }
	want := SecretRefs{
		Provisioner: ref("provisioner-data"), ControllerPublish: ref("controllerpublish-data"), NodeStage: ref("nodestage-data"),
		NodePublish: ref("nodepublish-data"), ControllerExpand: ref("controllerexpand-data"), NodeExpand: ref("nodeexpand-data"),
		ControllerModify: ref("controllermodify-data"),
	}
	if diff := cmp.Diff(want, refs, cmp.AllowUnexported(SecretRefs{})); diff != "" {
		t.Errorf("references (-want +got):\n%s", diff)
	}
}

// The modify secret takes the default secret when it names none of its own, as every
// kind does upstream.
func TestTheModifySecretFallsBackToTheDefaultSecret(t *testing.T) {
	refs, err := ResolveSecretRefs(map[string]string{DefaultSecret.NameKey: "all", DefaultSecret.NamespaceKey: "ns"}, "pvc-1", annotatedClaim())
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(&v1.SecretReference{Name: "all", Namespace: "ns"}, refs.ControllerModify); diff != "" {
		t.Errorf("modify secret (-want +got):\n%s", diff)
	}
}

func TestResolveTemplate(t *testing.T) {
	values := map[string]string{"pv.name": "pvc-1", "pvc.annotations['a']": "x"}
	for _, tc := range []struct {
		template, want string
		wantErr        bool
	}{
		{template: "plain", want: "plain"},
		{template: "${pv.name}", want: "pvc-1"},
		{template: "a-${pv.name}-${pvc.annotations['a']}-b", want: "a-pvc-1-x-b"},
		{template: "cost$", want: "cost$"},
		{template: "a$-b", want: "a$-b"},
		{template: "$$", want: "$$"},
		{template: "${pv.name", wantErr: true},
		{template: "${}", wantErr: true},
		{template: "$pv", wantErr: true},
		{template: "${PV.NAME}", wantErr: true},
		{template: "${pv.name}${nope}", wantErr: true},
	} {
		got, err := resolveTemplate(tc.template, values)
		if (err != nil) != tc.wantErr {
			t.Errorf("%q: error %v, want error %v", tc.template, err, tc.wantErr)
			continue
		}
		if got != tc.want {
			t.Errorf("%q resolved to %q, want %q", tc.template, got, tc.want)
		}
	}
}

// FuzzResolveTemplate: resolving never panics, and succeeds only when every ${token} in
// the template is one of the allowed keys, each replaced by its value. The seeds run as a
// normal test; `go test -fuzz=FuzzResolveTemplate ./provisioner` explores further.
func FuzzResolveTemplate(f *testing.F) {
	for _, seed := range []string{
		"", "plain", "${pv.name}", "${pvc.name}-${pvc.namespace}", "${pvc.annotations['k']}",
		"${pvc.annotations['other']}", "${", "$", "$$", "${}", "${${pv.name}}", "$pv", "}${pv.name}{",
		"${pvc.annotations['k']}}", "\x00${pv.name}\xff", "${pvc.uid}",
	} {
		f.Add(seed, "annotation-value")
	}
	f.Fuzz(func(t *testing.T, template, annotation string) {
		claim := &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{
			Name: "claim", Namespace: "ns", Annotations: map[string]string{"k": annotation},
		}}
		for _, values := range []map[string]string{namespaceTemplateValues("pv", claim), nameTemplateValues("pv", claim)} {
			got, err := resolveTemplate(template, values)
			if err != nil {
				return
			}
			// Recompute by hand: every ${...} must be an allowed key.
			var want strings.Builder
			rest := template
			for {
				i := strings.Index(rest, "${")
				if i < 0 {
					want.WriteString(rest)
					break
				}
				want.WriteString(rest[:i])
				end := strings.IndexByte(rest[i+2:], '}')
				if end < 0 {
					t.Fatalf("%q resolved to %q despite an unterminated token", template, got)
				}
				token := rest[i+2 : i+2+end]
				v, ok := values[token]
				if !ok {
					t.Fatalf("%q resolved to %q with token %q outside the allowed keys %v", template, got, token, values)
				}
				want.WriteString(v)
				rest = rest[i+3+end:]
			}
			if got != want.String() {
				t.Fatalf("%q resolved to %q, want %q", template, got, want.String())
			}
		}
		// The namespace must never see what the claim's user controls.
		if ns, err := resolveTemplate(template, namespaceTemplateValues("pv", claim)); err == nil &&
			(strings.Contains(template, "pvc.name") || strings.Contains(template, "pvc.annotations")) && strings.Contains(template, "${") {
			if strings.Contains(template, "${pvc.name}") || strings.Contains(template, "${pvc.annotations[") {
				t.Fatalf("namespace template %q resolved to %q using a claim-controlled token", template, ns)
			}
		}
	})
}
