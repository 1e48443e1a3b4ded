package record

import (
	"encoding/json"
	"fmt"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
)

// storeOfBatches is a store whose cache holds events events, each carrying perEvent records
// of a 150-node cluster's claims, and the claims' UIDs.
func storeOfBatches(tb testing.TB, events, perEvent int) (*Store, []string) {
	tb.Helper()
	s, err := NewStore(StoreConfig{Kube: fake.NewClientset(), Driver: drv, Source: v1.EventSource{Component: "test"}})
	if err != nil {
		tb.Fatal(err)
	}
	var uids []string
	for e := range events {
		var carried []Carried
		for r := range perEvent {
			c := claimFor(fmt.Sprintf("c%d-%d", e, r), fmt.Sprintf("uid-%d-%d", e, r), "fast")
			rec, err := New(drv, "", nil, largeClusterRequest("pvc-"+string(c.UID), 150))
			if err != nil {
				tb.Fatal(err)
			}
			value, _ := rec.Encode()
			carried = append(carried, Carried{Claim: ClaimReference(c), Record: value})
			uids = append(uids, string(c.UID))
		}
		ev := s.writer.openingEvent(carried[0].Claim, carried[0].Record)
		ev.Name, ev.UID, ev.ResourceVersion = fmt.Sprintf("ev-%d", e), types.UID(fmt.Sprintf("ev-uid-%d", e)), "1"
		also, _ := json.Marshal(carried[1:])
		ev.Annotations[AnnAlso] = string(also)
		if err := s.informer.GetIndexer().Add(ev); err != nil {
			tb.Fatal(err)
		}
	}
	return s, uids
}

// What the informer handlers ask of the records for each claim and record event: is the
// claim's record open? A cache of 20 events of 8 records of a 150-node cluster.
func BenchmarkIsOpenOverBatchesOfALargeCluster(b *testing.B) {
	s, uids := storeOfBatches(b, 20, 8)
	for _, uid := range uids {
		s.IsOpen(uid)
	}
	b.ResetTimer()
	for b.Loop() {
		for _, uid := range uids {
			if !s.IsOpen(uid) {
				b.Fatalf("claim %s: no open record", uid)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/float64(len(uids)), "µs/claim")
}
