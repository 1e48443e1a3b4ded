package migrate

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"

	"go.yaml.in/yaml/v3"
)

// document is one document of the input, kept as written unless it changes.
type document struct {
	sep  string // the separator line before it ("---"), "" for a first document without one
	raw  string
	node *yaml.Node // the parsed document; nil when it holds no object

	apiVersion, kind, name, namespace string
	changed                           bool
}

// splitDocuments cuts a stream of YAML documents at its "---" lines.
func splitDocuments(data []byte) []*document {
	var docs []*document
	cur := &document{}
	var body strings.Builder
	for line := range strings.Lines(string(data)) {
		trimmed := strings.TrimRight(line, "\r\n")
		if trimmed == "---" || strings.HasPrefix(trimmed, "--- ") {
			cur.raw = body.String()
			if cur.sep != "" || strings.TrimSpace(cur.raw) != "" {
				docs = append(docs, cur)
			}
			cur, body = &document{sep: trimmed}, strings.Builder{}
			continue
		}
		body.WriteString(line)
	}
	cur.raw = body.String()
	if cur.sep != "" || strings.TrimSpace(cur.raw) != "" {
		docs = append(docs, cur)
	}
	return docs
}

// parse reads the document's object, if it holds one.
func (d *document) parse() error {
	var n yaml.Node
	if err := yaml.Unmarshal([]byte(d.raw), &n); err != nil {
		return err
	}
	if n.Kind != yaml.DocumentNode || len(n.Content) == 0 || n.Content[0].Kind != yaml.MappingNode {
		if n.Kind == 0 || (len(n.Content) > 0 && n.Content[0].Tag == "!!null") {
			return nil
		}
		return fmt.Errorf("not a Kubernetes object")
	}
	d.node = &n
	root := n.Content[0]
	d.apiVersion = scalar(get(root, "apiVersion"))
	d.kind = scalar(get(root, "kind"))
	meta := get(root, "metadata")
	d.name = scalar(get(meta, "name"))
	d.namespace = scalar(get(meta, "namespace"))
	return nil
}

// root is the document's top mapping.
func (d *document) root() *yaml.Node { return d.node.Content[0] }

// render writes the document: as read, unless it changed.
func (d *document) render(out *bytes.Buffer) error {
	if d.sep != "" {
		out.WriteString(d.sep + "\n")
	}
	if !d.changed {
		out.WriteString(d.raw)
		if d.raw != "" && !strings.HasSuffix(d.raw, "\n") {
			out.WriteString("\n")
		}
		return nil
	}
	enc := yaml.NewEncoder(out)
	enc.SetIndent(2)
	if err := enc.Encode(d.node); err != nil {
		return fmt.Errorf("%s %s: %w", d.kind, d.name, err)
	}
	return enc.Close()
}

func (d *document) String() string {
	if d.namespace != "" {
		return d.kind + " " + d.namespace + "/" + d.name
	}
	return d.kind + " " + d.name
}

// get is the value of key in a mapping node, nil if n is none or lacks it.
func get(n *yaml.Node, key string) *yaml.Node {
	if n == nil || n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return n.Content[i+1]
		}
	}
	return nil
}

// set puts v under key in the mapping n, in place if the key exists, else at the end.
func set(n *yaml.Node, key string, v *yaml.Node) {
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			n.Content[i+1] = v
			return
		}
	}
	n.Content = append(n.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: key}, v)
}

// remove deletes key from the mapping n.
func remove(n *yaml.Node, key string) {
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			n.Content = append(n.Content[:i], n.Content[i+2:]...)
			return
		}
	}
}

// path walks mapping keys from n.
func path(n *yaml.Node, keys ...string) *yaml.Node {
	for _, k := range keys {
		n = get(n, k)
	}
	return n
}

func scalar(n *yaml.Node) string {
	if n == nil || n.Kind != yaml.ScalarNode {
		return ""
	}
	return n.Value
}

// decode reads a node into v through JSON, so Kubernetes' types decode as the API does.
func decode(n *yaml.Node, v any) error {
	var x any
	if err := n.Decode(&x); err != nil {
		return err
	}
	b, err := json.Marshal(x)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// encode is v as a node in block style, its keys in the order of its JSON.
func encode(v any) (*yaml.Node, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var n yaml.Node
	if err := yaml.Unmarshal(b, &n); err != nil {
		return nil, err
	}
	plain(&n)
	return n.Content[0], nil
}

func plain(n *yaml.Node) {
	n.Style = 0
	for _, c := range n.Content {
		plain(c)
	}
}
