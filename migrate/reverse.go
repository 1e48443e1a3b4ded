package migrate

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
	corev1 "k8s.io/api/core/v1"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

// migrated are the flags of a csi-sidecars container migrate wrote: each sidecar's own,
// and the shared ones.
type migrated struct {
	own    map[string]map[string][]token
	shared map[string][]token
	env    []corev1.EnvVar
}

// parseMigrated reads a csi-sidecars container's args: a subcommand's, or combined mode's.
func (r *run) parseMigrated(args []string) (*migrated, error) {
	m := &migrated{own: map[string]map[string][]token{}, shared: map[string][]token{}}
	add := func(sidecar string, t token) {
		if t.shared {
			m.shared[t.name] = append(m.shared[t.name], t)
			return
		}
		if m.own[sidecar] == nil {
			m.own[sidecar] = map[string][]token{}
		}
		m.own[sidecar][t.name] = append(m.own[sidecar][t.name], t)
	}
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		toks, err := r.cat.tokens(args[0], args[1:])
		if err != nil {
			return nil, err
		}
		for _, t := range toks {
			add(args[0], t)
		}
		return m, nil
	}
	args = lifecycle.NormalizeArgs(args)
	for i := 0; i < len(args); i++ {
		body, ok := strings.CutPrefix(args[i], "--")
		if !ok {
			body, ok = strings.CutPrefix(args[i], "-")
		}
		if !ok {
			return nil, fmt.Errorf("unexpected argument %q", args[i])
		}
		name, value, hasValue := strings.Cut(body, "=")
		if name == "controllers" {
			if !hasValue {
				i++
			}
			continue
		}
		sidecar, flagName := "", name
		f := r.cat.shared.Lookup(name)
		if f == nil && len(name) == 1 {
			f = r.cat.shared.ShorthandLookup(name)
		}
		if f == nil {
			for _, s := range r.cat.names {
				if rest, ok := strings.CutPrefix(name, s+"-"); ok && r.cat.own[s].Lookup(rest) != nil && len(s) > len(sidecar) {
					sidecar, flagName, f = s, rest, r.cat.own[s].Lookup(rest)
				}
			}
		}
		if f == nil {
			return nil, fmt.Errorf("unknown flag: %s", args[i])
		}
		if !hasValue && f.NoOptDefVal == "" {
			if i+1 >= len(args) {
				return nil, fmt.Errorf("flag needs an argument: %s", args[i])
			}
			i++
			value, hasValue = args[i], true
		}
		add(sidecar, token{name: f.Name, value: value, hasValue: hasValue, shared: sidecar == ""})
		_ = flagName
	}
	return m, nil
}

func (r *run) reverse() error {
	reversed := 0
	for _, d := range r.docs {
		if !isWorkload(d) {
			continue
		}
		tmpl := path(d.root(), "spec", "template")
		anns := path(tmpl, "metadata", "annotations")
		v := get(anns, annotation)
		if v == nil {
			continue
		}
		var rs recordSet
		if err := json.Unmarshal([]byte(v.Value), &rs); err != nil {
			return InputError{fmt.Errorf("%s: annotation %s: %w", d, annotation, err)}
		}
		cs := path(tmpl, "spec", "containers")
		if cs == nil {
			return InputError{fmt.Errorf("%s: annotation %s but no containers", d, annotation)}
		}
		names := make([]string, len(cs.Content))
		for i, n := range cs.Content {
			names[i] = scalar(get(n, "name"))
		}
		parsed := map[string]*migrated{}
		for _, rec := range rs.Containers {
			if parsed[rec.Into] != nil {
				continue
			}
			i := slices.Index(names, rec.Into)
			if i < 0 {
				return InputError{fmt.Errorf("%s: annotation %s records container %s, which the pod does not have", d, annotation, rec.Into)}
			}
			var c corev1.Container
			if err := decode(cs.Content[i], &c); err != nil {
				return InputError{fmt.Errorf("%s container %s: %w", d, rec.Into, err)}
			}
			m, err := r.parseMigrated(c.Args)
			if err != nil {
				return InputError{fmt.Errorf("%s container %s: %w", d, rec.Into, err)}
			}
			m.env = c.Env
			parsed[rec.Into] = m
		}
		// The other containers in their order, then each restored at its recorded place.
		var content []*yaml.Node
		for i, n := range cs.Content {
			if parsed[names[i]] == nil {
				content = append(content, n)
			}
		}
		recs := slices.Clone(rs.Containers)
		slices.SortStableFunc(recs, func(a, b record) int { return a.Index - b.Index })
		for _, rec := range recs {
			c, err := r.restore(d, rec, parsed[rec.Into])
			if err != nil {
				return err
			}
			n, err := encodeContainer(c)
			if err != nil {
				return err
			}
			at := min(rec.Index, len(content))
			content = slices.Insert(content, at, n)
		}
		cs.Content = content
		remove(anns, annotation)
		if len(anns.Content) == 0 {
			remove(get(tmpl, "metadata"), "annotations")
		}
		d.changed = true
		reversed++
		for _, e := range rs.Edits {
			r.undo(e)
		}
		var restored []string
		for _, rec := range rs.Containers {
			restored = append(restored, rec.Container.Name)
		}
		r.say("%s: restored upstream containers %s.", d, strings.Join(restored, ", "))
	}
	if reversed == 0 {
		r.say("No pod template with annotation %s: nothing to reverse.", annotation)
	}
	return nil
}

// restore is the upstream container of rec, with the flag values the csi-sidecars
// container has now.
func (r *run) restore(d *document, rec record, m *migrated) (corev1.Container, error) {
	c := *rec.Container.DeepCopy()
	if img, ok := r.opts.UpstreamImages[rec.Sidecar]; ok {
		c.Image = img
	} else {
		r.say("%s: container %s keeps its recorded image %s (no --upstream-image %s=...).", d, c.Name, c.Image, rec.Sidecar)
	}
	var orig []string
	if len(c.Command) > 0 {
		orig = append(orig, c.Command[1:]...)
	}
	orig = append(orig, c.Args...)
	toks, err := r.cat.tokens(rec.Sidecar, orig)
	if err != nil {
		return c, InputError{fmt.Errorf("%s: recorded container %s: %w", d, c.Name, err)}
	}
	own := map[string][]token{}
	for k, v := range m.own[rec.Sidecar] {
		own[k] = slices.Clone(v)
	}
	changed := false
	var out []string
	for _, t := range toks {
		switch {
		case t.shared && slices.Contains(special, t.name), !t.shared && t.name == "health-port":
			// Merged by rules of their own (the diagnostics endpoint, the probe's port): as
			// they were.
		case !t.shared:
			vals := own[t.name]
			if len(vals) == 0 {
				changed = true
				r.say("%s: container %s: --%s is no longer set in the csi-sidecars container; left out.", d, c.Name, t.name)
				continue
			}
			own[t.name] = vals[1:]
			if meaning(nil, vals[0]) != meaning(nil, t) {
				changed = true
				t = vals[0]
			}
		case len(m.shared[t.name]) > 0:
			// The value in meaning: $(VAR) of each container's env expanded.
			n := m.shared[t.name][0]
			if meaning(m.env, n) != meaning(rec.Container.Env, t) {
				changed = true
				t = n
			}
		}
		out = append(out, t.spelled(""))
	}
	delete(own, "health-port") // written by migrate from the endpoint flags, restored above
	for _, name := range sortedKeys(own) {
		for _, t := range own[name] {
			changed = true
			out = append(out, t.spelled(""))
		}
	}
	if changed {
		c.Command = slices.Clone(c.Command[:min(1, len(c.Command))])
		c.Args = out
	}
	return c, nil
}

// meaning is a flag's value as the binary sees it: a bare boolean flag is true, $(VAR) of
// the container's env expanded.
func meaning(env []corev1.EnvVar, t token) string {
	if !t.hasValue {
		return "true"
	}
	return expand(env, t.value)
}

// undo restores a field that migrate changed in another document, if it is as migrate
// left it.
func (r *run) undo(e edit) {
	for _, d := range r.docs {
		if d.node == nil || d.kind != e.Kind || d.name != e.Name || d.namespace != e.Namespace {
			continue
		}
		parts := strings.Split(e.Path, ".")
		n := d.root()
		for _, p := range parts[:len(parts)-1] {
			if i, err := strconv.Atoi(p); err == nil && n != nil && n.Kind == yaml.SequenceNode && i < len(n.Content) {
				n = n.Content[i]
			} else {
				n = get(n, p)
			}
		}
		last := parts[len(parts)-1]
		if n == nil || scalar(get(n, last)) != e.After {
			r.say("%s: %s was changed since the migration; left as it is.", d, e.Path)
			return
		}
		if e.Before == nil {
			remove(n, last)
		} else {
			set(n, last, scalarNode(*e.Before))
		}
		d.changed = true
	}
}
