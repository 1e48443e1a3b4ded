package migrate

import (
	"encoding/json"
	"fmt"
	"net"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// member is one upstream sidecar container of a pod.
type member struct {
	index   int
	c       corev1.Container
	sidecar string
	args    []string // its flags: the command's after the binary, then args
	toks    []token
	canon   map[string]string
	gates   map[string]string // feature gates it sets, k -> "true"/"false"
}

// pod is a converted pod template and what changed around it.
type pod struct {
	doc       *document
	template  *yaml.Node
	labels    map[string]string
	namespace string
	moves     []portMove
	record    recordSet

	serviceAccount string
	sidecars       []string        // the sidecars of the pod's upstream containers
	leaderElection map[string]bool // those with --leader-election
}

// portMove is a port of an upstream container whose server is now the diagnostics
// endpoint of the container that replaced it.
type portMove struct {
	container string
	from      int32
	fromName  string
	into      string
	to        int32
	toName    string
}

// recordSet is the pod template annotation's value: what --reverse restores.
type recordSet struct {
	Containers []record `json:"containers"`
	Edits      []edit   `json:"edits,omitempty"`
}

// record is one upstream container as it was, and the container it went into.
type record struct {
	Into      string           `json:"into"`
	Index     int              `json:"index"`
	Sidecar   string           `json:"sidecar"`
	Container corev1.Container `json:"container"`
}

// edit is a field of another document that was changed: a Service's targetPort.
type edit struct {
	Kind      string  `json:"kind"`
	Namespace string  `json:"namespace,omitempty"`
	Name      string  `json:"name"`
	Path      string  `json:"path"`
	Before    *string `json:"before,omitempty"`
	After     string  `json:"after"`
}

// special flags are not compared as shared flags: they are merged by rules of their own.
var special = []string{"http-endpoint", "metrics-address", "v", "feature-gates", "version"}

func (r *run) forward() error {
	var pods []*pod
	for _, d := range r.docs {
		if !isWorkload(d) {
			continue
		}
		p, err := r.convertPod(d)
		if err != nil {
			return err
		}
		if p != nil {
			pods = append(pods, p)
		}
	}
	if len(pods) == 0 {
		r.say("No upstream sidecar container found: nothing changed.")
		return nil
	}
	for _, d := range r.docs {
		switch {
		case d.node == nil:
		case d.kind == "Service":
			r.repointService(d, pods)
		case d.kind == "ServiceMonitor" || d.kind == "PodMonitor":
			r.repointMonitor(d, pods)
		}
	}
	r.checkRBAC(pods)
	for _, p := range pods {
		if err := p.writeRecord(); err != nil {
			return err
		}
		for _, m := range p.moves {
			r.say("Outside this input: %s: container %s's port %s is gone; its server is %s's diagnostics endpoint, port %s. Point any Service, ServiceMonitor, scrape config or NetworkPolicy not in this input at it.",
				p.doc, m.container, portString(m.from, m.fromName), m.into, portString(m.to, m.toName))
		}
	}
	r.say("Resources: requests summed; a limit summed where every merged container had one of that resource, else none. (`make bench`'s figures for the four controller sidecars in one process are lower: see README, \"Sizing memory\".)")
	r.say("Leases keep upstream's names: during a rolling update upstream and csi-sidecars replicas hand each over. Keep --drain-timeout (20s) below terminationGracePeriodSeconds.")
	return nil
}

func portString(port int32, name string) string {
	if name != "" {
		return fmt.Sprintf("%d (%s)", port, name)
	}
	return strconv.Itoa(int(port))
}

// writeRecord puts the record for --reverse on the pod template.
func (p *pod) writeRecord() error {
	b, err := json.MarshalIndent(p.record, "", "  ")
	if err != nil {
		return err
	}
	meta := get(p.template, "metadata")
	if meta == nil {
		meta = &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
		p.template.Content = append([]*yaml.Node{{Kind: yaml.ScalarNode, Tag: "!!str", Value: "metadata"}, meta}, p.template.Content...)
	}
	ann := get(meta, "annotations")
	if ann == nil || ann.Kind != yaml.MappingNode {
		ann = &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
		set(meta, "annotations", ann)
	}
	set(ann, annotation, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: string(b) + "\n", Style: yaml.LiteralStyle})
	p.doc.changed = true
	return nil
}

// convertPod replaces the upstream sidecar containers of d's pod template; nil if it has
// none.
func (r *run) convertPod(d *document) (*pod, error) {
	tmpl := path(d.root(), "spec", "template")
	cs := path(tmpl, "spec", "containers")
	if cs == nil || cs.Kind != yaml.SequenceNode {
		return nil, nil
	}
	all := make([]corev1.Container, len(cs.Content))
	var members []*member
	for i, n := range cs.Content {
		if err := decode(n, &all[i]); err != nil {
			return nil, InputError{fmt.Errorf("%s container %d: %w", d, i, err)}
		}
		c := all[i]
		s := sidecarOf(c.Image, c.Command)
		if s == "" {
			continue
		}
		m := &member{index: i, c: c, sidecar: s}
		if len(c.Command) > 0 {
			m.args = append(m.args, c.Command[1:]...)
		}
		m.args = append(m.args, c.Args...)
		var err error
		if m.toks, err = r.cat.tokens(s, m.args); err != nil {
			return nil, InputError{fmt.Errorf("%s container %s (%s): %w", d, c.Name, s, err)}
		}
		// Values compare as the kubelet passes them: $(VAR) of the container's env expanded.
		var expanded []string
		for _, t := range m.toks {
			if t.name != "feature-gates" {
				expanded = append(expanded, token{name: t.name, value: expand(c.Env, t.value), hasValue: t.hasValue, shared: true}.spelled(""))
			}
		}
		if m.canon, err = canonical(s, expanded); err != nil {
			// A value the kubelet expands ($(VAR)) may not parse here: compare as written.
			m.canon = map[string]string{}
			for _, t := range m.toks {
				m.canon[t.name] = expand(c.Env, t.value)
			}
		}
		m.gates = map[string]string{}
		for _, t := range m.toks {
			if t.name == "feature-gates" {
				for kv := range strings.SplitSeq(t.value, ",") {
					k, v, _ := strings.Cut(strings.TrimSpace(kv), "=")
					if b, err := strconv.ParseBool(strings.TrimSpace(v)); err == nil {
						v = strconv.FormatBool(b)
					}
					if k != "" {
						m.gates[k] = v
					}
				}
			}
		}
		members = append(members, m)
	}
	if len(members) == 0 {
		return nil, nil
	}
	p := &pod{doc: d, template: tmpl, namespace: d.namespace, labels: map[string]string{}, leaderElection: map[string]bool{}}
	p.serviceAccount = scalar(path(tmpl, "spec", "serviceAccountName"))
	if p.serviceAccount == "" {
		p.serviceAccount = scalar(path(tmpl, "spec", "serviceAccount"))
	}
	for _, m := range members {
		p.sidecars = append(p.sidecars, m.sidecar)
		p.leaderElection[m.sidecar] = r.cat.leads[m.sidecar] && m.canon["leader-election"] == "true"
	}
	if l := path(tmpl, "metadata", "labels"); l != nil {
		_ = l.Decode(&p.labels)
	}

	groups := r.group(d, members)
	taken := map[string]bool{}
	for i, c := range all {
		if !slices.ContainsFunc(members, func(m *member) bool { return m.index == i }) {
			taken[c.Name] = true
		}
	}
	built := map[int]*yaml.Node{} // by the index of the group's first member
	for _, g := range groups {
		var c corev1.Container
		if len(g) == 1 {
			c = r.single(g[0])
		} else {
			name := "csi-sidecars"
			for n := 2; taken[name]; n++ {
				name = fmt.Sprintf("csi-sidecars-%d", n)
			}
			c = r.merge(d, p, g, name)
		}
		taken[c.Name] = true
		n, err := encodeContainer(c)
		if err != nil {
			return nil, fmt.Errorf("%s container %s: %w", d, c.Name, err)
		}
		built[g[0].index] = n
		for _, m := range g {
			p.record.Containers = append(p.record.Containers, record{Into: c.Name, Index: m.index, Sidecar: m.sidecar, Container: m.c})
		}
	}
	var content []*yaml.Node
	for i, n := range cs.Content {
		switch {
		case built[i] != nil:
			content = append(content, built[i])
		case slices.ContainsFunc(members, func(m *member) bool { return m.index == i }):
		default:
			content = append(content, n)
		}
	}
	cs.Content = content
	d.changed = true
	return p, nil
}

// encodeContainer is c as a node, without the empty resources JSON gives every container.
func encodeContainer(c corev1.Container) (*yaml.Node, error) {
	n, err := encode(c)
	if err != nil {
		return nil, err
	}
	if r := get(n, "resources"); r != nil && len(r.Content) == 0 {
		remove(n, "resources")
	}
	return n, nil
}

// group puts the members into as few containers as their flags, env and mounts allow: each
// joins the first group it agrees with, then members of smaller groups that agree with the
// largest join it.
func (r *run) group(d *document, members []*member) [][]*member {
	var groups [][]*member
	for _, m := range members {
		placed := false
		for i, g := range groups {
			if len(r.conflicts(g, m)) == 0 {
				groups[i] = append(g, m)
				placed = true
				break
			}
		}
		if !placed {
			groups = append(groups, []*member{m})
		}
	}
	largest := 0
	for i, g := range groups {
		if len(g) > len(groups[largest]) {
			largest = i
		}
	}
	for i, g := range groups {
		if i == largest {
			continue
		}
		groups[i] = slices.DeleteFunc(g, func(m *member) bool {
			if len(r.conflicts(groups[largest], m)) > 0 {
				return false
			}
			groups[largest] = append(groups[largest], m)
			return true
		})
	}
	main := groups[largest]
	slices.SortFunc(main, func(a, b *member) int { return a.index - b.index })
	groups = slices.DeleteFunc(groups, func(g []*member) bool { return len(g) == 0 })
	for _, g := range groups {
		if g[0] == main[0] {
			continue
		}
		for _, m := range g {
			r.say("%s: container %s (%s) not merged with %s: %s.", d, m.c.Name, m.sidecar, main[0].c.Name, strings.Join(r.conflicts(main, m), "; "))
		}
	}
	return groups
}

// expand replaces $(VAR) references to env vars with literal values, as the kubelet does.
func expand(env []corev1.EnvVar, s string) string {
	for _, e := range env {
		if e.ValueFrom == nil {
			s = strings.ReplaceAll(s, "$("+e.Name+")", e.Value)
		}
	}
	return s
}

// conflicts are the reasons m cannot share a process with the group g.
func (r *run) conflicts(g []*member, m *member) []string {
	var out []string
	seen := map[string]bool{}
	for _, o := range g {
		if o.sidecar == m.sidecar {
			out = append(out, fmt.Sprintf("a second %s (%s is one)", m.sidecar, o.c.Name))
			continue
		}
		names := map[string]bool{}
		for _, x := range []*member{o, m} {
			for name := range x.canon {
				if r.isShared(x.sidecar, name) && !slices.Contains(special, name) {
					names[name] = true
				}
			}
		}
		for _, name := range sortedKeys(names) {
			if !r.cat.uses(o.sidecar, name) || !r.cat.uses(m.sidecar, name) {
				continue
			}
			if a, b := r.effective(o, name), r.effective(m, name); a != b && !seen[name] {
				seen[name] = true
				out = append(out, fmt.Sprintf("--%s is %q in %s and %q in %s, a shared flag with no per-sidecar form", name, a, o.c.Name, b, m.c.Name))
			}
		}
		for _, pair := range [][2]*member{{o, m}, {m, o}} {
			a, b := pair[0], pair[1]
			for _, gate := range sortedKeys(a.gates) {
				v := a.gates[gate]
				if bv, ok := b.gates[gate]; ok && bv != v {
					out = append(out, fmt.Sprintf("feature gate %s is %s in %s and %s in %s", gate, v, a.c.Name, bv, b.c.Name))
				} else if !ok && slices.Contains(r.cat.gates[b.sidecar], gate) && r.gateDefault(gate) != v {
					out = append(out, fmt.Sprintf("feature gate %s=%s of %s would change %s (%s reads it too)", gate, v, a.c.Name, b.c.Name, b.sidecar))
				}
			}
		}
		for _, e := range m.c.Env {
			if i := slices.IndexFunc(o.c.Env, func(x corev1.EnvVar) bool { return x.Name == e.Name }); i >= 0 && !reflect.DeepEqual(o.c.Env[i], e) {
				out = append(out, fmt.Sprintf("env %s differs between %s and %s", e.Name, o.c.Name, m.c.Name))
			}
		}
		for _, v := range m.c.VolumeMounts {
			if i := slices.IndexFunc(o.c.VolumeMounts, func(x corev1.VolumeMount) bool { return x.MountPath == v.MountPath }); i >= 0 && !reflect.DeepEqual(o.c.VolumeMounts[i], v) {
				out = append(out, fmt.Sprintf("%s mounts %s at %s, %s mounts %s there", o.c.Name, o.c.VolumeMounts[i].Name, v.MountPath, m.c.Name, v.Name))
			}
		}
	}
	return out
}

func (r *run) isShared(sidecar, name string) bool {
	return r.cat.shared.Lookup(name) != nil && r.cat.own[sidecar].Lookup(name) == nil
}

// effective is the value of a shared flag for m: as set, else the default.
func (r *run) effective(m *member, name string) string {
	if v, ok := m.canon[name]; ok {
		return v
	}
	return r.cat.shared.Lookup(name).DefValue
}

func (r *run) gateDefault(gate string) string {
	for _, s := range r.cat.names {
		if d, ok := r.cat.gateDefaults[s][gate]; ok {
			return strconv.FormatBool(d)
		}
	}
	return ""
}

// single is m alone in csi-sidecars' image: the subcommand first, the args as they were.
func (r *run) single(m *member) corev1.Container {
	c := *m.c.DeepCopy()
	c.Image = r.opts.Image
	c.Command = nil
	c.Args = append([]string{m.sidecar}, m.args...)
	for _, p := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe, c.StartupProbe} {
		execProbe(m, p)
	}
	return c
}

// execProbe runs an exec probe that called upstream's binary with csi-sidecars' subcommand.
func execProbe(m *member, p *corev1.Probe) bool {
	if p == nil || p.Exec == nil || len(p.Exec.Command) == 0 || sidecarOf("", p.Exec.Command[:1]) != m.sidecar {
		return false
	}
	p.Exec.Command = append([]string{"/csi-sidecars", m.sidecar}, lifecycle.NormalizeArgs(p.Exec.Command[1:])...)
	return true
}

// endpoint is an address a member served diagnostics on.
type endpoint struct {
	m    *member
	addr string
	flag string
}

func addrPort(addr string) (int32, bool) {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, false
	}
	n, err := strconv.ParseInt(port, 10, 32)
	return int32(n), err == nil
}

// merge builds the one container that runs the group g.
func (r *run) merge(d *document, p *pod, g []*member, name string) corev1.Container {
	var names, containers []string
	for _, m := range g {
		names = append(names, m.sidecar)
		containers = append(containers, m.c.Name)
	}
	r.say("%s: containers %s merged into %s (--controllers=%s).", d, strings.Join(containers, ", "), name, strings.Join(names, ","))
	c := corev1.Container{Name: name, Image: r.opts.Image}
	args := []string{"--controllers=" + strings.Join(names, ",")}

	// Verbosity: the highest, which changes only the logs.
	vmax, vset, vdiff := 0, false, false
	for _, m := range g {
		if v, ok := m.canon["v"]; ok {
			n, _ := strconv.Atoi(v)
			if vset && n != vmax {
				vdiff = true
			}
			vmax, vset = max(vmax, n), true
		} else if vset {
			vdiff = true
		}
	}
	if vset {
		args = append(args, "--v="+strconv.Itoa(vmax))
		if vdiff {
			r.say("%s: %s logs at the highest -v of the merged containers, %d.", d, name, vmax)
		}
	}
	// Feature gates: the union; conflicts kept sidecars apart already.
	gates := map[string]string{}
	var gateOrder []string
	for _, m := range g {
		for _, t := range m.toks {
			if t.name != "feature-gates" {
				continue
			}
			for kv := range strings.SplitSeq(t.value, ",") {
				k, v, _ := strings.Cut(strings.TrimSpace(kv), "=")
				if _, ok := gates[k]; !ok && k != "" {
					gateOrder = append(gateOrder, k)
				}
				gates[k] = v
			}
		}
	}
	if len(gateOrder) > 0 {
		var kvs []string
		for _, k := range gateOrder {
			kvs = append(kvs, k+"="+gates[k])
		}
		args = append(args, "--feature-gates="+strings.Join(kvs, ","))
	}

	// The diagnostics endpoint: the first member's; the others' ports move to it.
	var eps []endpoint
	for _, m := range g {
		for _, t := range m.toks {
			switch {
			case t.shared && t.name == "http-endpoint" && m.sidecar == "livenessprobe":
				// Alone, upstream's livenessprobe answers its probe there; combined, on its
				// own port.
				if port, ok := addrPort(t.value); ok {
					args = append(args, fmt.Sprintf("--livenessprobe-health-port=%d", port))
				}
			case t.shared && (t.name == "http-endpoint" || t.name == "metrics-address"):
				eps = append(eps, endpoint{m, t.value, t.name})
			case !t.shared && t.name == "health-port" && m.sidecar == "node-driver-registrar" && t.value != "0":
				eps = append(eps, endpoint{m, ":" + t.value, "health-port"})
			}
		}
	}
	var chosenPort int32
	var chosenName string
	if len(eps) > 0 {
		ep := eps[0]
		args = append(args, "--http-endpoint="+ep.addr)
		chosenPort, _ = addrPort(ep.addr)
		for _, cp := range ep.m.c.Ports {
			if cp.ContainerPort == chosenPort {
				chosenName = cp.Name
			}
		}
		r.say("%s: %s serves /metrics and /healthz on one endpoint, %s (%s's --%s).", d, name, ep.addr, ep.m.c.Name, ep.flag)
		for _, o := range eps[1:] {
			port, ok := addrPort(o.addr)
			if !ok {
				r.say("%s: %s's --%s=%s: its port is not a number; point what used it at %s.", d, o.m.c.Name, o.flag, o.addr, ep.addr)
				continue
			}
			if o.m == ep.m && port == chosenPort {
				continue
			}
			mv := portMove{container: o.m.c.Name, from: port, into: name, to: chosenPort, toName: chosenName}
			for _, cp := range o.m.c.Ports {
				if cp.ContainerPort == port {
					mv.fromName = cp.Name
				}
			}
			p.moves = append(p.moves, mv)
		}
	}

	// Shared flags once, each sidecar's own with its name as prefix.
	from := map[string]*member{}
	for _, m := range g {
		for _, t := range m.toks {
			switch {
			case slices.Contains(special, t.name) && t.shared:
			case t.name == "health-port" && (m.sidecar == "node-driver-registrar"):
			case t.shared && !r.cat.uses(m.sidecar, t.name):
				if !slices.ContainsFunc(g, func(o *member) bool { return r.cat.uses(o.sidecar, t.name) }) {
					r.say("%s: %s's --%s dropped: %s does not use it.", d, m.c.Name, t.name, m.sidecar)
				}
			case t.shared:
				if f, ok := from[t.name]; ok && f != m {
					continue
				}
				from[t.name] = m
				args = append(args, t.spelled(""))
			default:
				args = append(args, t.spelled(m.sidecar))
			}
		}
	}
	c.Args = args

	for _, m := range g {
		if c.ImagePullPolicy == "" {
			c.ImagePullPolicy = m.c.ImagePullPolicy
		}
		if c.WorkingDir == "" {
			c.WorkingDir = m.c.WorkingDir
		}
		if c.TerminationMessagePath == "" {
			c.TerminationMessagePath = m.c.TerminationMessagePath
			c.TerminationMessagePolicy = m.c.TerminationMessagePolicy
		}
		if m.c.Lifecycle != nil {
			if c.Lifecycle == nil {
				c.Lifecycle = m.c.Lifecycle.DeepCopy()
			} else {
				r.say("%s: %s's lifecycle hooks dropped: %s runs %s's.", d, m.c.Name, name, containers[0])
			}
		}
		for _, e := range m.c.Env {
			if !slices.ContainsFunc(c.Env, func(x corev1.EnvVar) bool { return x.Name == e.Name }) {
				c.Env = append(c.Env, e)
			}
		}
		for _, e := range m.c.EnvFrom {
			if !slices.ContainsFunc(c.EnvFrom, func(x corev1.EnvFromSource) bool { return reflect.DeepEqual(x, e) }) {
				c.EnvFrom = append(c.EnvFrom, e)
			}
		}
		for _, v := range m.c.VolumeMounts {
			if !slices.ContainsFunc(c.VolumeMounts, func(x corev1.VolumeMount) bool { return x.MountPath == v.MountPath }) {
				c.VolumeMounts = append(c.VolumeMounts, v)
			}
		}
		for _, v := range m.c.VolumeDevices {
			if !slices.ContainsFunc(c.VolumeDevices, func(x corev1.VolumeDevice) bool { return x.DevicePath == v.DevicePath }) {
				c.VolumeDevices = append(c.VolumeDevices, v)
			}
		}
		for _, cp := range m.c.Ports {
			if slices.ContainsFunc(p.moves, func(mv portMove) bool { return mv.container == m.c.Name && mv.from == cp.ContainerPort }) {
				continue
			}
			if slices.ContainsFunc(c.Ports, func(x corev1.ContainerPort) bool { return x.ContainerPort == cp.ContainerPort }) {
				continue
			}
			if cp.Name != "" && slices.ContainsFunc(c.Ports, func(x corev1.ContainerPort) bool { return x.Name == cp.Name }) {
				r.say("%s: %s's port %d keeps no name: %s names another port %s.", d, m.c.Name, cp.ContainerPort, name, cp.Name)
				cp.Name = ""
			}
			c.Ports = append(c.Ports, cp)
		}
	}

	// One probe of each kind: the first member's, pointed at the endpoint.
	for _, kind := range []struct {
		name string
		get  func(*corev1.Container) **corev1.Probe
	}{
		{"liveness", func(c *corev1.Container) **corev1.Probe { return &c.LivenessProbe }},
		{"readiness", func(c *corev1.Container) **corev1.Probe { return &c.ReadinessProbe }},
		{"startup", func(c *corev1.Container) **corev1.Probe { return &c.StartupProbe }},
	} {
		for _, m := range g {
			src := *kind.get(&m.c)
			if src == nil {
				continue
			}
			if *kind.get(&c) != nil {
				r.say("%s: %s's %s probe dropped: %s has one %s probe, %s's.", d, m.c.Name, kind.name, name, kind.name, containers[slices.IndexFunc(g, func(o *member) bool { return *kind.get(&o.c) != nil })])
				continue
			}
			pr := src.DeepCopy()
			if !execProbe(m, pr) {
				repoint(m, pr, p.moves)
			}
			*kind.get(&c) = pr
		}
	}

	var notes []string
	c.Resources, notes = sumResources(g)
	for _, n := range notes {
		r.say("%s: %s: %s.", d, name, n)
	}
	c.SecurityContext, notes = mergeSecurityContext(g)
	for _, n := range notes {
		r.say("%s: %s: %s.", d, name, n)
	}
	return c
}

// repoint points a probe of m at the port its server moved to.
func repoint(m *member, p *corev1.Probe, moves []portMove) {
	var port *intstr.IntOrString
	switch {
	case p.HTTPGet != nil:
		port = &p.HTTPGet.Port
	case p.TCPSocket != nil:
		port = &p.TCPSocket.Port
	default:
		return
	}
	num := port.IntVal
	if port.Type == intstr.String {
		i := slices.IndexFunc(m.c.Ports, func(cp corev1.ContainerPort) bool { return cp.Name == port.StrVal })
		if i < 0 {
			return
		}
		num = m.c.Ports[i].ContainerPort
	}
	for _, mv := range moves {
		if mv.container == m.c.Name && mv.from == num {
			if mv.toName != "" {
				*port = intstr.FromString(mv.toName)
			} else {
				*port = intstr.FromInt32(mv.to)
			}
		}
	}
}

// sumResources adds the members' requests (a limit without a request counts as its
// request, as the API server defaults it) and their limits where each has one.
func sumResources(g []*member) (corev1.ResourceRequirements, []string) {
	var out corev1.ResourceRequirements
	var notes []string
	names := map[corev1.ResourceName]bool{}
	for _, m := range g {
		for n := range m.c.Resources.Requests {
			names[n] = true
		}
		for n := range m.c.Resources.Limits {
			names[n] = true
		}
	}
	for _, n := range sortedKeys(names) {
		var req, lim resource.Quantity
		hasReq, allLim := false, true
		var without []string
		for _, m := range g {
			q, ok := m.c.Resources.Requests[n]
			if !ok {
				q, ok = m.c.Resources.Limits[n]
			}
			if ok {
				req.Add(q)
				hasReq = true
			}
			if l, ok := m.c.Resources.Limits[n]; ok {
				lim.Add(l)
			} else {
				allLim = false
				without = append(without, m.c.Name)
			}
		}
		if hasReq {
			if out.Requests == nil {
				out.Requests = corev1.ResourceList{}
			}
			out.Requests[n] = req
		}
		if allLim {
			if out.Limits == nil {
				out.Limits = corev1.ResourceList{}
			}
			out.Limits[n] = lim
		} else if !lim.IsZero() {
			notes = append(notes, fmt.Sprintf("no %s limit, as %s had none", n, strings.Join(without, ", ")))
		}
	}
	return out, notes
}

// mergeSecurityContext is the strictest security context every member ran with: a
// privilege any member had is kept, a restriction only when every member had it.
func mergeSecurityContext(g []*member) (*corev1.SecurityContext, []string) {
	var notes []string
	scs := make([]corev1.SecurityContext, len(g))
	for i, m := range g {
		if m.c.SecurityContext != nil {
			scs[i] = *m.c.SecurityContext
		}
	}
	var out corev1.SecurityContext
	all := func(f func(corev1.SecurityContext) *bool, want bool) bool {
		for _, s := range scs {
			if p := f(s); p == nil || *p != want {
				return false
			}
		}
		return true
	}
	anyTrue := func(f func(corev1.SecurityContext) *bool) bool {
		return slices.ContainsFunc(scs, func(s corev1.SecurityContext) bool { p := f(s); return p != nil && *p })
	}
	ptr := func(b bool) *bool { return &b }
	privileged := func(s corev1.SecurityContext) *bool { return s.Privileged }
	switch {
	case anyTrue(privileged):
		out.Privileged = ptr(true)
	case all(privileged, false):
		out.Privileged = ptr(false)
	}
	escalation := func(s corev1.SecurityContext) *bool { return s.AllowPrivilegeEscalation }
	switch {
	case all(escalation, false):
		out.AllowPrivilegeEscalation = ptr(false)
	case anyTrue(escalation):
		out.AllowPrivilegeEscalation = ptr(true)
	}
	if all(func(s corev1.SecurityContext) *bool { return s.ReadOnlyRootFilesystem }, true) {
		out.ReadOnlyRootFilesystem = ptr(true)
	}
	if all(func(s corev1.SecurityContext) *bool { return s.RunAsNonRoot }, true) {
		out.RunAsNonRoot = ptr(true)
	}
	same := func(field string, f func(corev1.SecurityContext) any) any {
		first := f(scs[0])
		for _, s := range scs[1:] {
			if !reflect.DeepEqual(f(s), first) {
				notes = append(notes, fmt.Sprintf("securityContext.%s left unset: the merged containers differ", field))
				return nil
			}
		}
		return first
	}
	if v, _ := same("runAsUser", func(s corev1.SecurityContext) any { return s.RunAsUser }).(*int64); v != nil {
		out.RunAsUser = v
	}
	if v, _ := same("runAsGroup", func(s corev1.SecurityContext) any { return s.RunAsGroup }).(*int64); v != nil {
		out.RunAsGroup = v
	}
	if v, _ := same("seccompProfile", func(s corev1.SecurityContext) any { return s.SeccompProfile }).(*corev1.SeccompProfile); v != nil {
		out.SeccompProfile = v
	}
	if v, _ := same("seLinuxOptions", func(s corev1.SecurityContext) any { return s.SELinuxOptions }).(*corev1.SELinuxOptions); v != nil {
		out.SELinuxOptions = v
	}
	if v, _ := same("appArmorProfile", func(s corev1.SecurityContext) any { return s.AppArmorProfile }).(*corev1.AppArmorProfile); v != nil {
		out.AppArmorProfile = v
	}
	if v, _ := same("procMount", func(s corev1.SecurityContext) any { return s.ProcMount }).(*corev1.ProcMountType); v != nil {
		out.ProcMount = v
	}
	// Capabilities: those any member added; dropped only what every member dropped.
	var add, drop []corev1.Capability
	for i, s := range scs {
		var d []corev1.Capability
		if s.Capabilities != nil {
			for _, a := range s.Capabilities.Add {
				if !slices.Contains(add, a) {
					add = append(add, a)
				}
			}
			d = s.Capabilities.Drop
		}
		if i == 0 {
			drop = slices.Clone(d)
		} else {
			drop = slices.DeleteFunc(drop, func(c corev1.Capability) bool { return !slices.Contains(d, c) })
		}
	}
	if len(add) > 0 || len(drop) > 0 {
		out.Capabilities = &corev1.Capabilities{Add: add, Drop: drop}
	}
	if reflect.DeepEqual(out, corev1.SecurityContext{}) {
		return nil, notes
	}
	return &out, notes
}

func sortedKeys[K ~string, V any](m map[K]V) []K {
	keys := make([]K, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
