package nodeid

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const testDriver = "test.csi.example.com"

func TestFromNode(t *testing.T) {
	tests := []struct {
		annotation string
		want       string
		ok         bool
	}{
		{`{"` + testDriver + `":"id-1","other":"x"}`, "id-1", true},
		{`{"other":"x"}`, "", false},
		{`not json`, "", false},
		{`{"` + testDriver + `":""}`, "", false},
	}
	for _, tc := range tests {
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", Annotations: map[string]string{NodesAnnotation: tc.annotation}}}
		got, ok := FromNode(testDriver, node)
		if got != tc.want || ok != tc.ok {
			t.Errorf("%s: got %q %v, want %q %v", tc.annotation, got, ok, tc.want, tc.ok)
		}
	}
	if _, ok := FromNode(testDriver, &corev1.Node{}); ok {
		t.Error("found an ID without the annotation")
	}
}
