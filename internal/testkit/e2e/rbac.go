package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Rules is an RBAC rule set in the shape of an upstream rbac.yaml: the ClusterRole's rules,
// and the Role's rules in the leader-election namespace.
type Rules struct {
	Cluster   []rbacv1.PolicyRule
	Namespace []rbacv1.PolicyRule
}

// Rule is one PolicyRule: apiGroup, resources and verbs.
func Rule(group string, resources []string, verbs ...string) rbacv1.PolicyRule {
	return rbacv1.PolicyRule{APIGroups: []string{group}, Resources: resources, Verbs: verbs}
}

// KubeconfigWithRules creates a ServiceAccount named name in the scenario's namespace,
// grants it exactly rules (a ClusterRole and ClusterRoleBinding, a Role and RoleBinding in
// the scenario's namespace, where the Leases are), and returns the path of a kubeconfig
// with a token of that ServiceAccount only.
func (s *Scenario) KubeconfigWithRules(name string, rules Rules) string {
	s.T.Helper()
	ctx := context.Background()
	full := s.Namespace + "-" + name
	subject := []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: name, Namespace: s.Namespace}}
	check := func(err error) {
		if err != nil {
			s.T.Fatalf("granting %s its rules: %v", name, err)
		}
	}
	_, err := s.Client.CoreV1().ServiceAccounts(s.Namespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	check(err)
	rbac := s.Client.RbacV1()
	_, err = rbac.ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: full}, Rules: rules.Cluster}, metav1.CreateOptions{})
	check(err)
	_, err = rbac.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: full}, Subjects: subject,
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: full}}, metav1.CreateOptions{})
	check(err)
	_, err = rbac.Roles(s.Namespace).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules.Namespace}, metav1.CreateOptions{})
	check(err)
	_, err = rbac.RoleBindings(s.Namespace).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name}, Subjects: subject,
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name}}, metav1.CreateOptions{})
	check(err)
	s.T.Cleanup(func() {
		_ = rbac.ClusterRoleBindings().Delete(context.Background(), full, metav1.DeleteOptions{})
		_ = rbac.ClusterRoles().Delete(context.Background(), full, metav1.DeleteOptions{})
	})

	// The authorizer reads roles through an informer: wait until a grant of each applies,
	// so the replica's first requests are not refused.
	user := "system:serviceaccount:" + s.Namespace + ":" + name
	for _, grant := range []struct {
		rules     []rbacv1.PolicyRule
		namespace string
	}{{rules.Cluster, ""}, {rules.Namespace, s.Namespace}} {
		if len(grant.rules) == 0 {
			continue
		}
		r := grant.rules[0]
		attrs := authorizationv1.ResourceAttributes{Verb: r.Verbs[0], Group: r.APIGroups[0], Resource: r.Resources[0], Namespace: grant.namespace}
		if res, sub, ok := strings.Cut(attrs.Resource, "/"); ok {
			attrs.Resource, attrs.Subresource = res, sub
		}
		s.WaitUntil(fmt.Sprintf("%s is granted %s %s", user, attrs.Verb, r.Resources[0]), func() bool {
			review, err := s.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
				User: user, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + s.Namespace, "system:authenticated"}, ResourceAttributes: &attrs,
			}}, metav1.CreateOptions{})
			return err == nil && review.Status.Allowed
		})
	}

	expiry := int64(3600)
	tr, err := s.Client.CoreV1().ServiceAccounts(s.Namespace).CreateToken(ctx, name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &expiry}}, metav1.CreateOptions{})
	check(err)
	path := filepath.Join(s.Dir, name+".kubeconfig")
	check(s.CP.WriteKubeconfig(path, tr.Status.Token))
	return path
}

var forbidden = regexp.MustCompile(`(?i)forbidden`)

// Forbidden returns the lines of the replica's log so far that report a refused request.
func (r *Replica) Forbidden() []string {
	var out []string
	for _, line := range strings.Split(r.Stderr(), "\n") {
		if forbidden.MatchString(line) {
			out = append(out, line)
		}
	}
	return out
}

// NoForbidden fails t with every line of the replicas' logs that reports a refused request.
func NoForbidden(t testing.TB, replicas ...*Replica) {
	t.Helper()
	for _, r := range replicas {
		for _, line := range r.Forbidden() {
			t.Errorf("%s: %s", r.Name, line)
		}
	}
}
