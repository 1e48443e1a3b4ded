package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/yaml"
)

// PodSpec reads a stream of YAML documents (a manifest) and returns the pod template of the
// Deployment, StatefulSet or DaemonSet of that kind and name: what a test runs a manifest's
// containers from.
func PodSpec(manifest []byte, kind, name string) (corev1.PodTemplateSpec, error) {
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(manifest), 4096)
	for {
		obj := &unstructured.Unstructured{}
		if err := dec.Decode(&obj.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return corev1.PodTemplateSpec{}, fmt.Errorf("e2e: the manifest has no %s %s", kind, name)
			}
			return corev1.PodTemplateSpec{}, fmt.Errorf("e2e: decoding the manifest: %w", err)
		}
		if obj.GetKind() != kind || obj.GetName() != name {
			continue
		}
		var typed any
		switch kind {
		case "Deployment":
			typed = &appsv1.Deployment{}
		case "StatefulSet":
			typed = &appsv1.StatefulSet{}
		case "DaemonSet":
			typed = &appsv1.DaemonSet{}
		default:
			return corev1.PodTemplateSpec{}, fmt.Errorf("e2e: %s is no workload with a pod template", kind)
		}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, typed); err != nil {
			return corev1.PodTemplateSpec{}, fmt.Errorf("e2e: %s %s: %w", kind, name, err)
		}
		switch w := typed.(type) {
		case *appsv1.Deployment:
			return w.Spec.Template, nil
		case *appsv1.StatefulSet:
			return w.Spec.Template, nil
		default:
			return typed.(*appsv1.DaemonSet).Spec.Template, nil
		}
	}
}

// ContainerEnv is a container's environment as the kubelet gives it: each variable's value,
// or for a field reference (the downward API) the value fields has for its path
// (spec.nodeName, metadata.name...). A variable of another source is an error: a test must
// say what it stands for.
func ContainerEnv(c corev1.Container, fields map[string]string) (map[string]string, error) {
	env := map[string]string{}
	for _, v := range c.Env {
		switch {
		case v.ValueFrom == nil:
			env[v.Name] = ExpandArgs([]string{v.Value}, env)[0]
		case v.ValueFrom.FieldRef != nil:
			value, ok := fields[v.ValueFrom.FieldRef.FieldPath]
			if !ok {
				return nil, fmt.Errorf("e2e: container %s: env %s refers to field %s, which the test does not give", c.Name, v.Name, v.ValueFrom.FieldRef.FieldPath)
			}
			env[v.Name] = value
		default:
			return nil, fmt.Errorf("e2e: container %s: env %s comes from a source the test cannot give", c.Name, v.Name)
		}
	}
	return env, nil
}

// EnvList is env as "NAME=value" entries, in the order of the container's variables.
func EnvList(c corev1.Container, env map[string]string) []string {
	var out []string
	for _, v := range c.Env {
		out = append(out, v.Name+"="+env[v.Name])
	}
	return out
}

// ExpandArgs expands the $(VAR) references of args from env, as the kubelet does a
// container's command and args: a reference to a variable env lacks stays as written, and
// $$ is a literal $.
func ExpandArgs(args []string, env map[string]string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		var b strings.Builder
		for j := 0; j < len(a); j++ {
			if a[j] != '$' || j+1 == len(a) {
				b.WriteByte(a[j])
				continue
			}
			switch a[j+1] {
			case '$':
				b.WriteByte('$')
				j++
				continue
			case '(':
				if end := strings.IndexByte(a[j+2:], ')'); end >= 0 {
					name := a[j+2 : j+2+end]
					if v, ok := env[name]; ok {
						b.WriteString(v)
					} else {
						b.WriteString(a[j : j+3+end])
					}
					j += 2 + end
					continue
				}
			}
			b.WriteByte('$')
		}
		out[i] = b.String()
	}
	return out
}

// SetFlags gives each flag of values (a name without dashes) that value in args, whichever
// spelling (-name, --name, with =) args use. It is an error when one is not in args: what
// a test substitutes must be there to be substituted.
func SetFlags(args []string, values map[string]string) ([]string, error) {
	out := slices.Clone(args)
	for name, value := range values {
		found := false
		for i, a := range out {
			flag := strings.TrimLeft(a, "-")
			if !strings.HasPrefix(a, "-") || (flag != name && !strings.HasPrefix(flag, name+"=")) {
				continue
			}
			if flag == name {
				return nil, fmt.Errorf("e2e: flag --%s without =value in %q: not substituted", name, args)
			}
			out[i] = "--" + name + "=" + value
			found = true
		}
		if !found {
			return nil, fmt.Errorf("e2e: no flag --%s in %q to substitute", name, args)
		}
	}
	return out, nil
}
