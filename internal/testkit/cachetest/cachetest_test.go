package cachetest

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// An object a watch delivers may be edited in place without touching the tracker's.
func TestCopyingWatchesHandOutCopies(t *testing.T) {
	cs := fake.NewClientset(&v1.Event{ObjectMeta: metav1.ObjectMeta{Name: "e", Namespace: "ns"}, Reason: "Kept"})
	CopyingWatches(cs)
	w, err := cs.CoreV1().Events("ns").Watch(t.Context(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	ev := (<-w.ResultChan()).Object.(*v1.Event)
	ev.Reason = "Edited"
	got, err := cs.CoreV1().Events("ns").Get(t.Context(), "e", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Reason != "Kept" {
		t.Errorf("the tracker's event has reason %q after the watched copy was edited, want Kept", got.Reason)
	}
}
