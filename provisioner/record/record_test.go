package record

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/objects"
)

const recordUID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"

func testRecord(t *testing.T, node string) *Record {
	t.Helper()
	r, err := New(drv, node, &v1.SecretReference{Name: "creds", Namespace: "ns"}, objects.CreateVolumeRequest("pvc-"+recordUID))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// claimWithRecord is a claim of the driver carrying rec (nil: none).
func recordedClaim(t *testing.T, rec *Record, change func(*v1.PersistentVolumeClaim)) *v1.PersistentVolumeClaim {
	t.Helper()
	c := claimFor("data", recordUID, "fast")
	if rec != nil {
		value, err := rec.Encode()
		if err != nil {
			t.Fatal(err)
		}
		c = With(c, value)
	}
	if change != nil {
		change(c)
	}
	return c
}

func TestARecordKeepsTheRequestButNeverItsSecrets(t *testing.T) {
	rec := testRecord(t, "n1")
	value, err := rec.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(value, "secret-value") {
		t.Fatalf("the record holds a secret's value: %s", value)
	}
	read, err := Of(recordedClaim(t, rec, nil))
	if err != nil {
		t.Fatal(err)
	}
	want := objects.CreateVolumeRequest("pvc-" + recordUID)
	want.Secrets = nil
	if !proto.Equal(read.req, want) || read.Node != "n1" || read.Driver != drv || read.Secret.Name != "creds" || !read.SameAs(rec) {
		t.Errorf("read back %+v with request %v, want the request without secrets %v", read, read.req, want)
	}
}

func TestARecordOfAHugeTopologyKeepsOnlyThePreferredSegment(t *testing.T) {
	req := objects.CreateVolumeRequest("pvc-" + recordUID)
	req.AccessibilityRequirements = &csi.TopologyRequirement{}
	for i := range 2000 {
		segment := &csi.Topology{Segments: map[string]string{"topology.example.com/node": fmt.Sprintf("node-%04d-with-a-long-name", i)}}
		req.AccessibilityRequirements.Requisite = append(req.AccessibilityRequirements.Requisite, segment)
		req.AccessibilityRequirements.Preferred = append([]*csi.Topology{segment}, req.AccessibilityRequirements.Preferred...)
	}
	rec, err := New(drv, "", nil, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Request) > recordBudget {
		t.Errorf("recorded request of %d bytes, budget %d", len(rec.Request), recordBudget)
	}
	ar := rec.req.AccessibilityRequirements
	first := req.AccessibilityRequirements.Preferred[0]
	if len(ar.GetRequisite()) != 1 || !proto.Equal(ar.Requisite[0], first) || len(ar.GetPreferred()) != 1 || !proto.Equal(ar.Preferred[0], first) {
		t.Errorf("recorded topology %v, want only the first preferred segment %v", ar, first)
	}
	if req.AccessibilityRequirements.Requisite[1] == nil || len(req.Secrets) == 0 {
		t.Error("recording changed the request to be sent")
	}
}

func TestRecordsOfOtherTopologyAskForTheSameVolume(t *testing.T) {
	a, b := testRecord(t, "n1"), testRecord(t, "n1")
	b.req.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{"k": "v"}}}}
	if !a.SameAs(b) {
		t.Error("a changed topology alone made the requests differ")
	}
	b.req.Parameters = map[string]string{"type": "slow"}
	if a.SameAs(b) {
		t.Error("other parameters did not make the requests differ")
	}
	if c := testRecord(t, "n2"); a.SameAs(c) {
		t.Error("another node did not make the records differ")
	}
}

func TestUnreadableRecordsAreErrorsAndNoRecordIsNone(t *testing.T) {
	for _, tc := range []struct {
		name, value string
	}{
		{"not JSON", "{"},
		{"no request", `{"driver":"d","volume":"v"}`},
		{"request for another name", `{"driver":"d","volume":"v","request":{"name":"w"}}`},
		{"no driver", `{"volume":"v","request":{"name":"v"}}`},
	} {
		c := claimFor("data", recordUID, "fast")
		c.Annotations[AnnProvisioning] = tc.value
		if r, err := Of(c); err == nil {
			t.Errorf("%s: read %+v, want an error", tc.name, r)
		}
	}
	if r, err := Of(claimFor("data", recordUID, "fast")); r != nil || err != nil {
		t.Errorf("claim without a record: %+v, %v", r, err)
	}
	// The finalizer alone (the annotation removed by hand): a live claim gets its
	// annotation back with its next record; a deleted one cannot be undone.
	half := claimFor("data", recordUID, "fast")
	half.Finalizers = []string{ProvisioningFinalizer}
	if r, err := Of(half); r != nil || err != nil || !Has(half) {
		t.Errorf("live claim with the finalizer alone: %+v, %v, Has %v; want none, and queued", r, err, Has(half))
	}
	half.DeletionTimestamp = ptr.To(metav1.Now())
	if _, err := Of(half); err == nil {
		t.Error("deleted claim with the finalizer alone: no error")
	}
}

func TestTheRecordGoesOnAndOffInOneWriteEach(t *testing.T) {
	claim := claimFor("data", recordUID, "fast")
	claim.Finalizers = []string{"kubernetes.io/pvc-protection"}
	on := With(claim, "{}")
	if on.Annotations[AnnProvisioning] != "{}" || len(on.Finalizers) != 2 || on.Finalizers[1] != ProvisioningFinalizer {
		t.Errorf("with the record: annotations %v, finalizers %v", on.Annotations, on.Finalizers)
	}
	off, had := Without(on)
	if !had || Has(off) || len(off.Finalizers) != 1 || off.Finalizers[0] != "kubernetes.io/pvc-protection" {
		t.Errorf("without the record: had %v, annotations %v, finalizers %v", had, off.Annotations, off.Finalizers)
	}
	if _, had := Without(off); had {
		t.Error("a claim without a record had one")
	}
	if len(claim.Finalizers) != 1 || Has(claim) {
		t.Error("the claim itself was changed")
	}
}

// The record of a claim is open from its "Provisioning" event until an event lists that
// one as closed; the oldest open one is the record; events about another claim, or
// unreadable, do not pass for it.
func TestARecordIsOpenUntilAnEventClosesIt(t *testing.T) {
	claim := claimFor("data", recordUID, "fast")
	rec, err := New(drv, "", nil, objects.CreateVolumeRequest("pvc-"+recordUID))
	if err != nil {
		t.Fatal(err)
	}
	other, err := New(drv, "n2", nil, objects.CreateVolumeRequest("pvc-"+recordUID))
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 12, 2, 1, 0, 0, 0, time.UTC)
	s := &eventWriter{driverLabel: DriverLabel(drv), now: func() time.Time { at = at.Add(time.Second); return at }}
	opening := func(r *Record) *v1.Event {
		ev := s.event(ClaimReference(claim), v1.EventTypeNormal, ReasonProvisioning, "")
		value, _ := r.Encode()
		ev.Annotations = map[string]string{AnnProvisioning: value}
		return ev
	}
	closing := func(names ...string) *v1.Event {
		ev := s.event(ClaimReference(claim), v1.EventTypeNormal, ReasonSucceeded, "")
		ev.Annotations = map[string]string{AnnCloses: strings.Join(names, ",")}
		return ev
	}
	first, second := opening(rec), opening(other)
	unreadable := opening(rec)
	unreadable.Annotations[AnnProvisioning] = "{"
	aboutAnother := opening(rec)
	aboutAnother.InvolvedObject.UID = "another"
	for _, tc := range []struct {
		name     string
		events   []*v1.Event
		wantNode string // of the open record; "-" for none
		wantErr  bool
	}{
		{name: "none", wantNode: "-"},
		{name: "opened", events: []*v1.Event{first}, wantNode: ""},
		{name: "opened and closed", events: []*v1.Event{first, closing(first.Name)}, wantNode: "-"},
		{name: "two open: the oldest", events: []*v1.Event{second, first}, wantNode: ""},
		{name: "the oldest closed", events: []*v1.Event{first, second, closing(first.Name)}, wantNode: "n2"},
		{name: "both closed by one", events: []*v1.Event{first, second, closing(first.Name, second.Name)}, wantNode: "-"},
		{name: "a closing event alone", events: []*v1.Event{closing("x")}, wantNode: "-"},
		{name: "about another claim", events: []*v1.Event{aboutAnother}, wantNode: "-"},
		{name: "unreadable", events: []*v1.Event{unreadable}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := OpenAmong(tc.events, recordUID)
			switch {
			case tc.wantErr:
				if err == nil {
					t.Errorf("record %+v, want an error", r)
				}
			case err != nil:
				t.Errorf("error %v", err)
			case tc.wantNode == "-":
				if r != nil {
					t.Errorf("open record %+v, want none", r.Record)
				}
			case r == nil:
				t.Error("no open record")
			case r.Record.Node != tc.wantNode || r.Record.Claim.Name != "data":
				t.Errorf("record of node %q about %v, want node %q about claim data", r.Record.Node, r.Record.Claim, tc.wantNode)
			}
		})
	}
}

// An event may carry the records of further claims of its namespace (a batch): each is
// open until an event about its own claim closes it; one about a claim of another
// namespace is no record.
func TestAnEventCarriesTheRecordsOfABatchEachClosedOnItsOwn(t *testing.T) {
	at := time.Date(2026, 12, 2, 1, 0, 0, 0, time.UTC)
	s := &eventWriter{driverLabel: DriverLabel(drv), now: func() time.Time { at = at.Add(time.Second); return at }}
	first, member := claimFor("a", "uid-a", "fast"), claimFor("data", recordUID, "fast")
	stranger := claimFor("b", "uid-b", "fast")
	stranger.Namespace = "elsewhere"
	value := func(c *v1.PersistentVolumeClaim) string {
		rec, err := New(drv, "", nil, objects.CreateVolumeRequest("pvc-"+string(c.UID)))
		if err != nil {
			t.Fatal(err)
		}
		v, _ := rec.Encode()
		return v
	}
	batch := s.event(ClaimReference(first), v1.EventTypeNormal, ReasonProvisioning, "")
	also, _ := json.Marshal([]Carried{
		{Claim: ClaimReference(member), Record: value(member)},
		{Claim: ClaimReference(stranger), Record: value(stranger)},
	})
	batch.Annotations = map[string]string{AnnProvisioning: value(first), AnnAlso: string(also)}

	if got := ClaimKeys(batch); !slices.Equal(got, []string{"uid-a", recordUID}) {
		t.Errorf("indexed under %q, want the first claim's UID and the member's of its namespace", got)
	}
	r, err := OpenAmong([]*v1.Event{batch}, recordUID)
	if err != nil || r == nil {
		t.Fatalf("the member's record: %+v, %v; want it open", r, err)
	}
	if r.Record.Claim.Name != "data" || r.Record.Volume != "pvc-"+recordUID || !slices.Equal(r.events, []string{batch.Name}) {
		t.Errorf("the member's record is about %v, volume %q, events %q", r.Record.Claim, r.Record.Volume, r.events)
	}
	if r, _ := OpenAmong([]*v1.Event{batch}, "uid-b"); r != nil {
		t.Errorf("a record about a claim of another namespace is open: %+v", r.Record)
	}
	// The first claim's closing event closes its record, not the member's (the index
	// gives each claim only the closing events about it).
	closeFirst := s.event(ClaimReference(first), v1.EventTypeNormal, ReasonSucceeded, "")
	closeFirst.Annotations = map[string]string{AnnCloses: batch.Name}
	if r, _ := OpenAmong([]*v1.Event{batch, closeFirst}, "uid-a"); r != nil {
		t.Errorf("the first claim's record is open after its closing event")
	}
	if r, _ := OpenAmong([]*v1.Event{batch}, recordUID); r == nil {
		t.Errorf("the member's record is closed by the first claim's closing event")
	}
	closeMember := s.event(ClaimReference(member), v1.EventTypeNormal, ReasonSucceeded, "")
	closeMember.Annotations = map[string]string{AnnCloses: batch.Name}
	if r, _ := OpenAmong([]*v1.Event{batch, closeMember}, recordUID); r != nil {
		t.Errorf("the member's record is open after its closing event")
	}
}

// Records written while the event of another waits for the API server go in one event
// (group commit): one write records them all, and each is open at once.
func TestRecordsWrittenTogetherShareOneEvent(t *testing.T) {
	kube := fake.NewClientset()
	release := make(chan struct{})
	var creates atomic.Int32
	kube.PrependReactor("create", "events", func(k8stesting.Action) (bool, runtime.Object, error) {
		if creates.Add(1) == 1 {
			<-release // the first event is slow to write
		}
		return false, nil, nil
	})
	s, err := NewStore(StoreConfig{Kube: kube, Driver: drv, Source: v1.EventSource{Component: "test"}})
	if err != nil {
		t.Fatal(err)
	}
	claims := []*v1.PersistentVolumeClaim{claimFor("c0", "uid-0", "fast"), claimFor("c1", "uid-1", "fast"), claimFor("c2", "uid-2", "fast"), claimFor("c3", "uid-3", "fast")}
	errs := make(chan error, len(claims))
	write := func(c *v1.PersistentVolumeClaim) {
		rec, err := New(drv, "", nil, objects.CreateVolumeRequest("pvc-"+string(c.UID)))
		if err != nil {
			errs <- err
			return
		}
		errs <- s.writer.writeRecord(context.Background(), c, rec)
	}
	go write(claims[0])
	if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return creates.Load() == 1, nil
	}); err != nil {
		t.Fatal("the first record's event was not written")
	}
	for _, c := range claims[1:] {
		go write(c)
	}
	if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		s.writer.batches.mu.Lock()
		defer s.writer.batches.mu.Unlock()
		return len(s.writer.batches.waiting["ns"]) == 3, nil
	}); err != nil {
		t.Fatal("the other records did not wait for the first event")
	}
	close(release)
	for range claims {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if n := creates.Load(); n != 2 {
		t.Errorf("%d events written for 4 records, want 2 (one, then the three that waited)", n)
	}
	for _, c := range claims {
		if r, err := s.Open(string(c.UID)); err != nil || r == nil || r.Record.Claim.Name != c.Name {
			t.Errorf("claim %s: open record %+v, %v", c.Name, r, err)
		}
	}
	events, _ := kube.CoreV1().Events("ns").List(context.Background(), metav1.ListOptions{})
	for _, ev := range events.Items {
		if ev.InvolvedObject.Name == "c1" && len(alsoRecorded(&ev)) != 2 {
			t.Errorf("the second event carries %d further records, want 2", len(alsoRecorded(&ev)))
		}
	}
	// The flush ends once it finds nothing more to write (after it answered the last).
	if err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		s.writer.batches.mu.Lock()
		defer s.writer.batches.mu.Unlock()
		return len(s.writer.batches.flushing) == 0 && len(s.writer.batches.waiting) == 0, nil
	}); err != nil {
		t.Errorf("batches left: flushing %v, waiting %v", s.writer.batches.flushing, s.writer.batches.waiting)
	}
}

// A flush that finds records waiting after a write lingers one token of the client's
// budget; a client without a limit (or a fake) has no linger.
func TestARecordBatchLingersOneTokenOfTheBudget(t *testing.T) {
	kube, err := kubernetes.NewForConfig(&rest.Config{Host: "http://127.0.0.1:1", QPS: 5, Burst: 10})
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewStore(StoreConfig{Kube: kube, Driver: drv, Source: v1.EventSource{Component: "test"}})
	if err != nil {
		t.Fatal(err)
	}
	if s.writer.linger != 200*time.Millisecond {
		t.Errorf("linger %v at QPS 5, want 200ms", s.writer.linger)
	}
	if s, _ := NewStore(StoreConfig{Kube: fake.NewClientset(), Driver: drv}); s.writer.linger != 0 {
		t.Errorf("linger %v without a rate limiter, want none", s.writer.linger)
	}
}

const drv = "drv.example.com"

func claimFor(name, uid, className string) *v1.PersistentVolumeClaim {
	return objects.ClaimFor(drv, name, uid, className)
}

// An open record holds its data source wherever the claim is: a claim may restore a
// snapshot of another namespace (CrossNamespaceVolumeDataSource), and its record is an
// event of the claim's namespace.
func TestAnOpenRecordHoldsASourceOfAnotherNamespace(t *testing.T) {
	s, err := NewStore(StoreConfig{Kube: fake.NewClientset(), Driver: drv, Source: v1.EventSource{Component: "test"}})
	if err != nil {
		t.Fatal(err)
	}
	restore := claimFor("restore", "uid-restore", "fast")
	restore.Namespace = "dst"
	rec, err := New(drv, "", nil, objects.CreateVolumeRequest("pvc-uid-restore"))
	if err != nil {
		t.Fatal(err)
	}
	rec.Source = "snapshot/src/snap"
	if err := s.writer.writeRecord(context.Background(), restore, rec); err != nil {
		t.Fatal(err)
	}
	if who, err := s.UsesSource("snapshot/src/snap"); err != nil || who != "dst/restore" {
		t.Errorf("UsesSource of the other namespace's snapshot = %q, %v; want dst/restore", who, err)
	}
	if who, err := s.UsesSource("snapshot/dst/snap"); err != nil || who != "" {
		t.Errorf("UsesSource of a snapshot of the claim's own namespace = %q, %v; want none", who, err)
	}
}
