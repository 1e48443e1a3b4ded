package migrate

import (
	"fmt"
	"strconv"

	"go.yaml.in/yaml/v3"
)

// selects tells whether a label selector (matchLabels form) picks the pod's labels.
func selects(sel map[string]string, labels map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func sameNamespace(a, b string) bool { return a == "" || b == "" || a == b }

// retarget points a port reference (a number or a container port's name) that named a
// moved port at where it moved; it returns the edit, nil if the reference is not moved.
func retarget(n *yaml.Node, byNumber int32, moves []portMove) (*string, string, bool) {
	for _, mv := range moves {
		match := false
		switch {
		case n == nil:
			match = byNumber != 0 && byNumber == mv.from
		case n.Tag == "!!int":
			v, _ := strconv.Atoi(n.Value)
			match = int32(v) == mv.from
		default:
			match = mv.fromName != "" && n.Value == mv.fromName
		}
		if !match {
			continue
		}
		var before *string
		if n != nil {
			v := n.Value
			before = &v
		}
		after := mv.toName
		if after == "" {
			after = strconv.Itoa(int(mv.to))
		}
		return before, after, true
	}
	return nil, "", false
}

func scalarNode(v string) *yaml.Node {
	tag := "!!str"
	if _, err := strconv.Atoi(v); err == nil {
		tag = "!!int"
	}
	return &yaml.Node{Kind: yaml.ScalarNode, Tag: tag, Value: v}
}

// repointService points the ports of a Service that selects a converted pod at the ports
// their servers moved to.
func (r *run) repointService(d *document, pods []*pod) {
	sel := map[string]string{}
	if s := path(d.root(), "spec", "selector"); s != nil {
		_ = s.Decode(&sel)
	}
	ports := path(d.root(), "spec", "ports")
	if ports == nil {
		return
	}
	for _, p := range pods {
		if !sameNamespace(d.namespace, p.namespace) || !selects(sel, p.labels) || len(p.moves) == 0 {
			continue
		}
		for i, pn := range ports.Content {
			tp := get(pn, "targetPort")
			port, _ := strconv.Atoi(scalar(get(pn, "port")))
			before, after, ok := retarget(tp, int32(port), p.moves)
			if !ok {
				continue
			}
			set(pn, "targetPort", scalarNode(after))
			field := fmt.Sprintf("spec.ports.%d.targetPort", i)
			p.record.Edits = append(p.record.Edits, edit{Kind: d.kind, Namespace: d.namespace, Name: d.name, Path: field, Before: before, After: after})
			d.changed = true
			r.say("%s: port %s now targets %s, the diagnostics endpoint of %s.", d, scalar(get(pn, "name")), after, p.doc)
		}
	}
}

// repointMonitor points a ServiceMonitor's targetPort, or a PodMonitor's port or
// targetPort, at where the server moved.
func (r *run) repointMonitor(d *document, pods []*pod) {
	list, fields := "endpoints", []string{"targetPort"}
	if d.kind == "PodMonitor" {
		list, fields = "podMetricsEndpoints", []string{"port", "targetPort"}
	}
	eps := path(d.root(), "spec", list)
	if eps == nil {
		return
	}
	sel := map[string]string{}
	if s := path(d.root(), "spec", "selector", "matchLabels"); s != nil {
		_ = s.Decode(&sel)
	}
	for _, p := range pods {
		if !sameNamespace(d.namespace, p.namespace) || len(p.moves) == 0 {
			continue
		}
		if d.kind == "PodMonitor" && !selects(sel, p.labels) {
			continue
		}
		for i, ep := range eps.Content {
			for _, f := range fields {
				n := get(ep, f)
				if n == nil {
					continue
				}
				before, after, ok := retarget(n, 0, p.moves)
				if !ok {
					continue
				}
				set(ep, f, scalarNode(after))
				p.record.Edits = append(p.record.Edits, edit{Kind: d.kind, Namespace: d.namespace, Name: d.name, Path: fmt.Sprintf("spec.%s.%d.%s", list, i, f), Before: before, After: after})
				d.changed = true
				r.say("%s: endpoint %d's %s now %s, the diagnostics endpoint of %s.", d, i, f, after, p.doc)
			}
		}
	}
}
