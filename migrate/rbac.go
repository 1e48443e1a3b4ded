package migrate

import (
	"fmt"
	"slices"
	"strings"

	rbacv1 "k8s.io/api/rbac/v1"
)

// need is a permission a sidecar cannot work without; those it degrades without (events,
// list and watch of Leases, capacity objects) are not checked.
type need struct {
	group, resource string
	verbs           []string
}

var needs = map[string][]need{
	"attacher": {
		{"storage.k8s.io", "volumeattachments", []string{"get", "list", "watch", "patch"}},
		{"storage.k8s.io", "volumeattachments/status", []string{"patch"}},
		{"", "persistentvolumes", []string{"get", "list", "watch", "patch"}},
		{"storage.k8s.io", "csinodes", []string{"get", "list", "watch"}},
	},
	"provisioner": {
		{"", "persistentvolumes", []string{"get", "list", "watch", "create", "delete"}},
		{"", "persistentvolumeclaims", []string{"get", "list", "watch", "update"}},
		{"storage.k8s.io", "storageclasses", []string{"get", "list", "watch"}},
		{"storage.k8s.io", "csinodes", []string{"get", "list", "watch"}},
		{"", "nodes", []string{"get", "list", "watch"}},
	},
	"resizer": {
		{"", "persistentvolumeclaims", []string{"get", "list", "watch"}},
		{"", "persistentvolumeclaims/status", []string{"patch"}},
		{"", "persistentvolumes", []string{"get", "list", "watch", "patch"}},
	},
	"snapshotter": {
		{"snapshot.storage.k8s.io", "volumesnapshotclasses", []string{"get", "list", "watch"}},
		{"snapshot.storage.k8s.io", "volumesnapshotcontents", []string{"get", "list", "watch", "patch"}},
		{"snapshot.storage.k8s.io", "volumesnapshotcontents/status", []string{"patch"}},
	},
	"health-monitor": {
		{"", "persistentvolumes", []string{"list", "watch"}},
		{"", "persistentvolumeclaims", []string{"list", "watch"}},
		{"", "persistentvolumeclaims/status", []string{"patch"}},
		{"", "events", []string{"create", "patch"}},
	},
}

// leaseNeed is what a sidecar with --leader-election needs in its Lease's namespace.
var leaseNeed = need{"coordination.k8s.io", "leases", []string{"get", "create", "update"}}

func allows(rules []rbacv1.PolicyRule, group, resource, verb string) bool {
	for _, r := range rules {
		if len(r.ResourceNames) > 0 {
			continue
		}
		if (slices.Contains(r.APIGroups, group) || slices.Contains(r.APIGroups, "*")) &&
			(slices.Contains(r.Resources, resource) || slices.Contains(r.Resources, "*")) &&
			(slices.Contains(r.Verbs, verb) || slices.Contains(r.Verbs, "*")) {
			return true
		}
	}
	return false
}

// checkRBAC checks that the roles of the input bound to each converted pod's service
// account grant what its sidecars need. It changes nothing.
func (r *run) checkRBAC(pods []*pod) {
	roles := map[string][]rbacv1.PolicyRule{}
	var crbs []rbacv1.ClusterRoleBinding
	var rbs []rbacv1.RoleBinding
	for _, d := range r.docs {
		if d.node == nil || !strings.HasPrefix(d.apiVersion, "rbac.authorization.k8s.io/") {
			continue
		}
		switch d.kind {
		case "ClusterRole", "Role":
			var role rbacv1.ClusterRole
			if decode(d.root(), &role) == nil {
				roles[d.kind+"/"+d.namespace+"/"+d.name] = role.Rules
			}
		case "ClusterRoleBinding":
			var b rbacv1.ClusterRoleBinding
			if decode(d.root(), &b) == nil {
				crbs = append(crbs, b)
			}
		case "RoleBinding":
			var b rbacv1.RoleBinding
			if decode(d.root(), &b) == nil {
				rbs = append(rbs, b)
			}
		}
	}
	for _, p := range pods {
		sa := p.serviceAccount
		if sa == "" {
			sa = "default"
		}
		binds := func(subjects []rbacv1.Subject) bool {
			return slices.ContainsFunc(subjects, func(s rbacv1.Subject) bool {
				return s.Kind == "ServiceAccount" && s.Name == sa && sameNamespace(s.Namespace, p.namespace)
			})
		}
		var cluster, local []rbacv1.PolicyRule
		var absent []string
		found := false
		lookup := func(kind, ns, name string) []rbacv1.PolicyRule {
			rules, ok := roles[kind+"/"+ns+"/"+name]
			if !ok && kind == "Role" {
				// A Role of a manifest without namespace is in the namespace it is applied to.
				rules, ok = roles[kind+"//"+name]
			}
			if !ok {
				absent = append(absent, kind+" "+name)
			}
			return rules
		}
		for _, b := range crbs {
			if binds(b.Subjects) {
				found = true
				cluster = append(cluster, lookup("ClusterRole", "", b.RoleRef.Name)...)
			}
		}
		for _, b := range rbs {
			if binds(b.Subjects) && sameNamespace(b.Namespace, p.namespace) {
				found = true
				ns := b.Namespace
				if b.RoleRef.Kind == "ClusterRole" {
					ns = ""
				}
				local = append(local, lookup(b.RoleRef.Kind, ns, b.RoleRef.Name)...)
			}
		}
		if !found {
			r.say("RBAC: %s: no binding of service account %s in the input; not checked.", p.doc, sa)
			continue
		}
		if len(absent) > 0 {
			slices.Sort(absent)
			r.say("RBAC: %s: service account %s is bound to roles not in the input (%s); not checked: apply them as before, unchanged.", p.doc, sa, strings.Join(slices.Compact(absent), ", "))
			continue
		}
		var missing []string
		check := func(sidecar string, n need, rules []rbacv1.PolicyRule) {
			var verbs []string
			for _, v := range n.verbs {
				if !allows(rules, n.group, n.resource, v) {
					verbs = append(verbs, v)
				}
			}
			if len(verbs) > 0 {
				res := n.resource
				if n.group != "" {
					res += "." + n.group
				}
				missing = append(missing, fmt.Sprintf("%s %s (%s)", strings.Join(verbs, ","), res, sidecar))
			}
		}
		for _, s := range p.sidecars {
			for _, n := range needs[s] {
				check(s, n, cluster)
			}
			if p.leaderElection[s] {
				check(s, leaseNeed, append(slices.Clone(cluster), local...))
			}
		}
		if len(missing) == 0 {
			r.say("RBAC: %s: service account %s has what its sidecars need; unchanged.", p.doc, sa)
		} else {
			r.say("RBAC: %s: service account %s lacks %s. Grant it: the csi-sidecars container needs what the containers it replaced needed.", p.doc, sa, strings.Join(missing, "; "))
		}
	}
}
