package snapshotter

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-lib-utils/metrics"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/component-base/metrics/legacyregistry"
	// Registers client-go's workqueue metrics in the legacy registry, as csi-snapshotter's
	// main does: the reference the sidecar's are compared with.
	_ "k8s.io/component-base/metrics/prometheus/workqueue"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The CSI methods the snapshotter calls, as csi-lib-utils labels them (method_name).
const (
	methodCreateSnapshot      = "/csi.v1.Controller/CreateSnapshot"
	methodDeleteSnapshot      = "/csi.v1.Controller/DeleteSnapshot"
	methodListSnapshots       = "/csi.v1.Controller/ListSnapshots"
	methodCreateGroupSnapshot = "/csi.v1.GroupController/CreateVolumeGroupSnapshot"
	methodDeleteGroupSnapshot = "/csi.v1.GroupController/DeleteVolumeGroupSnapshot"
)

// Upstream's workqueue names (csi-snapshotter v8.7's sidecar controller).
const (
	contentQueue = "csi-snapshotter-content"
	groupQueue   = "csi-snapshotter-groupsnapshotcontent"
)

// The snapshotter's /metrics are csi-snapshotter's: csi_sidecar_operations_seconds of each
// CSI call it made (a dynamic snapshot's CreateSnapshot, a pre-provisioned one's
// ListSnapshots, DeleteSnapshot, a group snapshot's Create- and DeleteVolumeGroupSnapshot)
// with the driver's name, in the labels and buckets csi-lib-utils gives csi-snapshotter;
// and client-go's workqueue metrics of upstream's queue names, the group one only when
// group snapshots are on (a standby with the gate off has none).
func TestMetricsAreCSISnapshotters(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	claims := s.claims(3)
	s.labelClaims("db", claims[1:]...)
	groupClass := s.groupClass(nil)
	r := s.start("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")
	r.WaitReady(t)
	off := s.start("replica-b", "--feature-gates=CSIVolumeGroupSnapshot=false")
	off.WaitReady(t)

	s.snapshot("dynamic", claims[0])
	s.preProvisioned("static", claims[0])
	s.volumeGroupSnapshot("db", groupClass, "db")
	s.waitReady("dynamic", "static")
	s.waitGroupReady("db")
	s.deleteSnapshot("dynamic")
	s.deleteSnapshot("static")
	s.deleteVolumeGroupSnapshot("db")
	s.waitGroupGone()

	code, body := r.Get("/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d %s", code, body)
	}
	got := parseMetrics(t, body)
	ref := upstreamReference(t, s.Driver.DriverName())

	// CSI call metrics: one series per method called, with the driver's name, OK.
	driver := s.Driver.DriverName()
	for _, m := range []string{methodCreateSnapshot, methodListSnapshots, methodDeleteSnapshot, methodCreateGroupSnapshot, methodDeleteGroupSnapshot} {
		found := got.find("csi_sidecar_operations_seconds_count", map[string]string{"method_name": m, "driver_name": driver, "grpc_status_code": "OK"})
		if len(found) != 1 || found[0].value < 1 {
			t.Errorf("csi_sidecar_operations_seconds_count of %s for driver %s: %v, want one series counting its calls", m, driver, found)
		}
	}
	for _, name := range []string{"csi_sidecar_operations_seconds_count", "csi_sidecar_operations_seconds_sum", "csi_sidecar_operations_seconds_bucket"} {
		want := ref.labelNames(name)
		if len(want) == 0 {
			t.Fatalf("csi-lib-utils' reference has no %s", name)
		}
		for _, sm := range got.find(name, nil) {
			if names := sm.labelNames(); !slices.Equal(names, want) {
				t.Errorf("%s labels %v, want csi-lib-utils' %v", sm, names, want)
			}
		}
	}
	wantBuckets := ref.values("csi_sidecar_operations_seconds_bucket", "le", map[string]string{"method_name": methodCreateSnapshot})
	if gotBuckets := got.values("csi_sidecar_operations_seconds_bucket", "le", map[string]string{"method_name": methodCreateSnapshot}); !slices.Equal(gotBuckets, wantBuckets) {
		t.Errorf("csi_sidecar_operations_seconds buckets %v, want csi-lib-utils' %v", gotBuckets, wantBuckets)
	}

	// Workqueue metrics: every family client-go exports per queue, for upstream's names.
	families := ref.workqueueFamilies()
	if len(families) < 5 {
		t.Fatalf("client-go's reference exports only %v", families)
	}
	for _, queue := range []string{contentQueue, groupQueue} {
		for _, family := range families {
			found := got.find(family, map[string]string{"name": queue})
			if len(found) == 0 {
				t.Errorf("no %s{name=%q}", family, queue)
			}
			for _, sm := range found {
				if names, want := sm.familyLabelNames(), ref.workqueueLabelNames(family); !slices.Equal(names, want) {
					t.Errorf("%s labels %v, want client-go's %v", sm, names, want)
				}
			}
		}
		if adds := got.find("workqueue_adds_total", map[string]string{"name": queue}); len(adds) != 1 || adds[0].value < 1 {
			t.Errorf("workqueue_adds_total{name=%q} %v, want the contents it queued counted", queue, adds)
		}
	}
	for _, sm := range got.find("workqueue_adds_total", nil) {
		if q := sm.labels["name"]; q != contentQueue && q != groupQueue {
			t.Errorf("workqueue %q: not one of upstream's queue names", q)
		}
	}

	// With the gate off there is no group queue; the content queue is there (a standby
	// builds its queues too).
	_, offBody := off.Get("/metrics")
	offMetrics := parseMetrics(t, offBody)
	if found := offMetrics.find("workqueue_adds_total", map[string]string{"name": groupQueue}); len(found) != 0 {
		t.Errorf("with CSIVolumeGroupSnapshot=false: %v, want no group queue", found)
	}
	if found := offMetrics.find("workqueue_adds_total", map[string]string{"name": contentQueue}); len(found) != 1 {
		t.Errorf("with CSIVolumeGroupSnapshot=false: workqueue_adds_total{name=%q} %v, want it", contentQueue, found)
	}
}

// preProvisioned creates a snapshot of claim in the backend and a VolumeSnapshot name of a
// pre-provisioned content (policy Delete) that names it.
func (s *scenario) preProvisioned(name, claim string) {
	s.T.Helper()
	snap, err := s.Driver.TakeSnapshot(s.Namespace+"-"+name, s.volumeOf(claim))
	if err != nil {
		s.T.Fatal(err)
	}
	contentName := s.Namespace + "-" + name
	if _, err := s.snaps.SnapshotV1().VolumeSnapshotContents().Create(s.ctx(), &snapv1.VolumeSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{Name: contentName},
		Spec: snapv1.VolumeSnapshotContentSpec{
			VolumeSnapshotRef: corev1.ObjectReference{Namespace: s.Namespace, Name: name},
			DeletionPolicy:    snapv1.VolumeSnapshotContentDelete,
			Driver:            s.Driver.DriverName(),
			Source:            snapv1.VolumeSnapshotContentSource{SnapshotHandle: &snap.ID},
		},
	}, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	if _, err := s.snaps.SnapshotV1().VolumeSnapshots(s.Namespace).Create(s.ctx(), &snapv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       snapv1.VolumeSnapshotSpec{Source: snapv1.VolumeSnapshotSource{VolumeSnapshotContentName: &contentName}},
	}, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
}

// reference is what csi-snapshotter's libraries export: a csi-lib-utils metrics manager made
// as csi-snapshotter's main makes it, with a call recorded, and client-go's workqueue
// metrics of a queue made here.
type reference struct {
	csi       metricSet
	workqueue metricSet
}

func upstreamReference(t *testing.T, driver string) reference {
	t.Helper()
	mm := metrics.NewCSIMetricsManager("")
	mm.SetDriverName(driver)
	mm.RecordMetrics(methodCreateSnapshot, nil, 300*time.Millisecond)
	mux := http.NewServeMux()
	mm.RegisterToServer(mux, "/metrics")
	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("csi-lib-utils' metrics: %d %s", rec.Code, rec.Body)
	}

	const name = "csi-sidecars-e2e-reference"
	q := workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: name})
	q.Add("x")
	item, _ := q.Get()
	q.AddRateLimited(item)
	q.Done(item)
	q.ShutDown()
	families, err := legacyregistry.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	wq := metricSet{}
	for _, f := range families {
		if !strings.HasPrefix(f.GetName(), "workqueue_") {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["name"] == name {
				wq = append(wq, sample{name: f.GetName(), labels: labels})
			}
		}
	}
	return reference{csi: parseMetrics(t, rec.Body.String()), workqueue: wq}
}

func (r reference) labelNames(name string) []string {
	if found := r.csi.find(name, nil); len(found) > 0 {
		return found[0].labelNames()
	}
	return nil
}

func (r reference) values(name, label string, match map[string]string) []string {
	return r.csi.values(name, label, match)
}

// workqueueFamilies are the names of client-go's workqueue metric families (a histogram or
// summary counts as one family: its name).
func (r reference) workqueueFamilies() []string {
	var out []string
	for _, sm := range r.workqueue {
		if !slices.Contains(out, sm.name) {
			out = append(out, sm.name)
		}
	}
	slices.Sort(out)
	return out
}

func (r reference) workqueueLabelNames(family string) []string {
	for _, sm := range r.workqueue {
		if sm.name == family {
			return sm.labelNames()
		}
	}
	return nil
}

// sample is one line of the Prometheus text format.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

func (sm sample) labelNames() []string {
	var out []string
	for k := range sm.labels {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// familyLabelNames are labelNames but a histogram bucket's le: the labels of its family.
func (sm sample) familyLabelNames() []string {
	return slices.DeleteFunc(sm.labelNames(), func(k string) bool { return k == "le" })
}

func (sm sample) String() string {
	var parts []string
	for _, k := range sm.labelNames() {
		parts = append(parts, fmt.Sprintf("%s=%q", k, sm.labels[k]))
	}
	return fmt.Sprintf("%s{%s} %v", sm.name, strings.Join(parts, ","), sm.value)
}

type metricSet []sample

// find returns the samples of name whose labels include match. For the name of a
// workqueue family, the samples of its histogram (_bucket, _sum, _count) are the family's.
func (ms metricSet) find(name string, match map[string]string) []sample {
	var out []sample
	for _, sm := range ms {
		if sm.name != name && !(isWorkqueueFamily(name) && familyOf(sm.name) == name) {
			continue
		}
		ok := true
		for k, v := range match {
			ok = ok && sm.labels[k] == v
		}
		if ok {
			out = append(out, sm)
		}
	}
	return out
}

// isWorkqueueFamily tells whether name is a workqueue family's.
func isWorkqueueFamily(name string) bool { return strings.HasPrefix(name, "workqueue_") }

// familyOf is the family of a histogram's sample.
func familyOf(name string) string {
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if f, ok := strings.CutSuffix(name, suffix); ok {
			return f
		}
	}
	return name
}

// values are the values of label on the samples of name that match, in order.
func (ms metricSet) values(name, label string, match map[string]string) []string {
	var out []string
	for _, sm := range ms.find(name, match) {
		out = append(out, sm.labels[label])
	}
	return out
}

// parseMetrics reads the Prometheus text format.
func parseMetrics(t *testing.T, text string) metricSet {
	t.Helper()
	var out metricSet
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		sm, err := parseSample(line)
		if err != nil {
			t.Fatalf("metrics line %q: %v", line, err)
		}
		out = append(out, sm)
	}
	return out
}

func parseSample(line string) (sample, error) {
	sm := sample{labels: map[string]string{}}
	i := strings.IndexAny(line, "{ ")
	if i < 0 {
		return sm, fmt.Errorf("no value")
	}
	sm.name, line = line[:i], line[i:]
	if strings.HasPrefix(line, "{") {
		line = line[1:]
		for !strings.HasPrefix(line, "}") {
			eq := strings.Index(line, `="`)
			if eq < 0 {
				return sm, fmt.Errorf("bad label at %q", line)
			}
			key := strings.TrimPrefix(line[:eq], ",")
			rest := line[eq+1:]
			// The quoted value ends at the first unescaped quote.
			end := 1
			for end < len(rest) && rest[end] != '"' {
				if rest[end] == '\\' {
					end++
				}
				end++
			}
			if end >= len(rest) {
				return sm, fmt.Errorf("unterminated value at %q", rest)
			}
			value, err := strconv.Unquote(rest[:end+1])
			if err != nil {
				return sm, err
			}
			sm.labels[key] = value
			line = strings.TrimPrefix(rest[end+1:], ",")
		}
		line = line[1:]
	}
	fields := strings.Fields(line)
	if len(fields) == 0 {
		return sm, fmt.Errorf("no value")
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return sm, err
	}
	sm.value = v
	return sm, nil
}
