package healthmonitor

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"testing"

	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/yaml"
)

// deploy/health-monitor grants what the monitor uses and nothing else: checked with
// SubjectAccessReviews against its roles as the API server's authorizer reads them.
func TestDeployRBACIsLeastPrivilege(t *testing.T) {
	s := newScenario(t, kube.Get(t), healthDriver())
	raw, err := os.ReadFile("../../../deploy/health-monitor/rbac.yaml")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	rbac := s.Client.RbacV1()
	prefix := s.Namespace + "-"
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(raw), 4096)
	for {
		var obj struct {
			Kind     string
			Metadata metav1.ObjectMeta
			Rules    []rbacv1.PolicyRule
			RoleRef  rbacv1.RoleRef `json:"roleRef"`
		}
		if err := dec.Decode(&obj); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			t.Fatal(err)
		}
		subject := []rbacv1.Subject{{Kind: "ServiceAccount", Name: "csi-health-monitor", Namespace: s.Namespace}}
		switch obj.Kind {
		case "ClusterRole":
			_, err = rbac.ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: prefix + obj.Metadata.Name}, Rules: obj.Rules}, metav1.CreateOptions{})
			t.Cleanup(func() { _ = rbac.ClusterRoles().Delete(ctx, prefix+obj.Metadata.Name, metav1.DeleteOptions{}) })
		case "ClusterRoleBinding":
			obj.RoleRef.Name = prefix + obj.RoleRef.Name
			_, err = rbac.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: prefix + obj.Metadata.Name}, Subjects: subject, RoleRef: obj.RoleRef}, metav1.CreateOptions{})
			t.Cleanup(func() { _ = rbac.ClusterRoleBindings().Delete(ctx, prefix+obj.Metadata.Name, metav1.DeleteOptions{}) })
		case "Role":
			_, err = rbac.Roles(s.Namespace).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: obj.Metadata.Name}, Rules: obj.Rules}, metav1.CreateOptions{})
		case "RoleBinding":
			_, err = rbac.RoleBindings(s.Namespace).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: obj.Metadata.Name}, Subjects: subject, RoleRef: obj.RoleRef}, metav1.CreateOptions{})
		}
		if err != nil {
			t.Fatalf("%s %s: %v", obj.Kind, obj.Metadata.Name, err)
		}
	}
	user := "system:serviceaccount:" + s.Namespace + ":csi-health-monitor"
	type access struct{ verb, group, resource, subresource, namespace string }
	allowed := func(a access) bool {
		t.Helper()
		rsp, err := s.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User: user, ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: a.verb, Group: a.group, Resource: a.resource, Subresource: a.subresource, Namespace: a.namespace}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return rsp.Status.Allowed
	}
	must := []access{
		{"list", "", "persistentvolumes", "", ""}, {"watch", "", "persistentvolumes", "", ""},
		{"list", "", "persistentvolumeclaims", "", ""}, {"watch", "", "persistentvolumeclaims", "", ""},
		{"patch", "", "persistentvolumeclaims", "status", "default"},
		{"list", "", "nodes", "", ""}, {"watch", "", "nodes", "", ""}, {"list", "", "pods", "", ""}, {"watch", "", "pods", "", ""},
		{"create", "", "events", "", "default"}, {"patch", "", "events", "", "default"},
		{"get", "coordination.k8s.io", "leases", "", s.Namespace}, {"watch", "coordination.k8s.io", "leases", "", s.Namespace},
		{"create", "coordination.k8s.io", "leases", "", s.Namespace}, {"update", "coordination.k8s.io", "leases", "", s.Namespace},
	}
	never := []access{
		{"get", "", "secrets", "", "default"}, {"patch", "", "persistentvolumeclaims", "", "default"},
		{"update", "", "persistentvolumeclaims", "status", "default"}, {"patch", "", "persistentvolumes", "", ""},
		{"get", "", "persistentvolumes", "", ""}, {"get", "", "persistentvolumeclaims", "", "default"},
		{"patch", "", "nodes", "", ""}, {"get", "", "pods", "", "default"}, {"list", "", "events", "", "default"},
		{"update", "", "events", "", "default"}, {"delete", "coordination.k8s.io", "leases", "", s.Namespace},
		{"update", "coordination.k8s.io", "leases", "", "kube-system"},
	}
	for _, a := range must {
		if !allowed(a) {
			t.Errorf("the monitor needs %+v; deploy/health-monitor does not grant it", a)
		}
	}
	for _, a := range never {
		if allowed(a) {
			t.Errorf("deploy/health-monitor grants %+v, which the monitor never uses", a)
		}
	}
}
