package snapshotter

import (
	"context"
	"encoding/json"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"

	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/csi-sidecars/csi-sidecars/internal/testkit/e2e"
	"github.com/csi-sidecars/csi-sidecars/internal/testkit/testdriver"
)

// The label the group tests select their claims by.
const groupLabel = "csi-sidecars.test/group"

// A VolumeGroupSnapshot v1 under the real snapshot-controller: it selects two of three
// claims by label; the snapshot-controller makes the VolumeGroupSnapshotContent of the
// group class's driver, the sidecar takes the group snapshot with
// CreateVolumeGroupSnapshot (upstream's name, the class's parameters) and records its
// handle and members on the status, the snapshot-controller makes a VolumeSnapshot and a
// content per member from that record, and everything is ready. No member is taken on its
// own. Deleting the VolumeGroupSnapshot deletes the group snapshot in the backend with
// DeleteVolumeGroupSnapshot naming its members, and every object with it: nothing is left.
func TestVolumeGroupSnapshotIsTakenRecordedAndDeleted(t *testing.T) {
	s := newScenario(t, testdriver.Config{})
	claims := s.claims(3)
	s.labelClaims("db", claims[:2]...)
	class := s.groupClass(nil)
	r := s.start("replica-a")
	s.WaitForHolder(s.leaseName, "replica-a")

	vgs := s.volumeGroupSnapshot("db", class, "db")
	ready := s.waitGroupReady("db")
	content := s.groupContent(*ready.Status.BoundVolumeGroupSnapshotContentName)
	if want := "groupsnapcontent-" + string(vgs.UID); content.Name != want {
		t.Errorf("group content %s, want upstream's name %s", content.Name, want)
	}
	wantVolumes := []string{s.volumeOf(claims[0]), s.volumeOf(claims[1])}
	if got := slices.Sorted(slices.Values(content.Spec.Source.VolumeHandles)); !slices.Equal(got, slices.Sorted(slices.Values(wantVolumes))) {
		t.Errorf("group content's volume handles %v, want the labelled claims' volumes %v", got, wantVolumes)
	}

	// The backend: one group snapshot of the two volumes, taken once, with the class's
	// parameters and upstream's name.
	groups := s.Driver.GroupSnapshots()
	if len(groups) != 1 {
		t.Fatalf("backend holds %d group snapshots, want 1: %+v", len(groups), groups)
	}
	group := groups[0]
	if want := "groupsnapshot-" + string(vgs.UID); group.Name != want {
		t.Errorf("group snapshot named %q, want upstream's %q", group.Name, want)
	}
	if !maps.Equal(group.Parameters, map[string]string{"tier": "platinum"}) {
		t.Errorf("group snapshot parameters %v, want the group class's", group.Parameters)
	}
	if !sameSet(group.SourceVolumeIDs, wantVolumes) {
		t.Errorf("group snapshot of volumes %v, want %v", group.SourceVolumeIDs, wantVolumes)
	}
	creates := e2e.CallsOn(s.Driver.Journal(), r, testdriver.MethodCreateVolumeGroupSnapshot)
	if len(creates) != 1 {
		t.Errorf("%d CreateVolumeGroupSnapshot calls for a group snapshot ready at once, want 1", len(creates))
	}
	if n := len(s.Driver.Calls(testdriver.MethodCreateSnapshot)); n != 0 {
		t.Errorf("%d CreateSnapshot calls: members are taken by the group's call only", n)
	}

	// The group content's status: what the driver answered.
	st := content.Status
	if st == nil || ptr.Deref(st.VolumeGroupSnapshotHandle, "") != group.ID || !ptr.Deref(st.ReadyToUse, false) || st.CreationTime == nil {
		t.Fatalf("group content status %s, want handle %s, ready, with a creation time", dump(st), group.ID)
	}
	if _, ok := content.Annotations["groupsnapshot.storage.kubernetes.io/volumegroupsnapshot-being-created"]; ok {
		t.Errorf("group content %s keeps the being-created annotation once ready", content.Name)
	}
	recorded := map[string]string{} // volume -> snapshot
	for _, m := range st.VolumeSnapshotInfoList {
		recorded[m.VolumeHandle] = m.SnapshotHandle
		if m.CreationTime == nil || m.RestoreSize == nil || !ptr.Deref(m.ReadyToUse, false) {
			t.Errorf("member %+v: want creation time, restore size, ready", m)
		}
	}
	for i, vol := range group.SourceVolumeIDs {
		if recorded[vol] != group.SnapshotIDs[i] {
			t.Errorf("volumeSnapshotInfoList records %q for volume %s, the backend's member is %s", recorded[vol], vol, group.SnapshotIDs[i])
		}
	}
	if len(st.VolumeSnapshotInfoList) != 2 {
		t.Errorf("volumeSnapshotInfoList %s, want the 2 members", dump(st.VolumeSnapshotInfoList))
	}

	// The members, made by the snapshot-controller from that record: a ready VolumeSnapshot
	// of each claim, owned by the VolumeGroupSnapshot, bound to a content recording the
	// member's handle and the group's.
	s.WaitUntil("the members' VolumeSnapshots ready", func() bool {
		vss := s.volumeSnapshots()
		if len(vss) != 2 {
			return false
		}
		for _, vs := range vss {
			if vs.Status == nil || !ptr.Deref(vs.Status.ReadyToUse, false) {
				return false
			}
		}
		return true
	})
	var memberClaims []string
	for name, vs := range s.volumeSnapshots() {
		memberClaims = append(memberClaims, ptr.Deref(vs.Spec.Source.PersistentVolumeClaimName, ""))
		if len(vs.OwnerReferences) != 1 || vs.OwnerReferences[0].UID != vgs.UID {
			t.Errorf("member VolumeSnapshot %s owned by %+v, want the VolumeGroupSnapshot", name, vs.OwnerReferences)
		}
		if ptr.Deref(vs.Status.VolumeGroupSnapshotName, "") != "db" {
			t.Errorf("member VolumeSnapshot %s names group %q, want db", name, ptr.Deref(vs.Status.VolumeGroupSnapshotName, ""))
		}
	}
	if !sameSet(memberClaims, claims[:2]) {
		t.Errorf("member VolumeSnapshots of claims %v, want %v", memberClaims, claims[:2])
	}
	contents := s.contents()
	if len(contents) != 2 {
		t.Errorf("%d VolumeSnapshotContents, want the 2 members'", len(contents))
	}
	for _, c := range contents {
		cst := c.Status
		if cst == nil || ptr.Deref(cst.VolumeGroupSnapshotHandle, "") != group.ID || ptr.Deref(cst.SnapshotHandle, "") != recorded[ptr.Deref(c.Spec.Source.VolumeHandle, "")] {
			t.Errorf("member content %s status %s, want group %s and the member recorded for its volume", c.Name, dump(cst), group.ID)
		}
	}
	if n := len(s.Driver.Snapshots()); n != 2 {
		t.Errorf("backend holds %d snapshots, want the 2 members", n)
	}

	// Deleted with its VolumeGroupSnapshot: the group snapshot and its members go, in one
	// call naming the members, and so do all the objects.
	s.deleteVolumeGroupSnapshot("db")
	s.waitGroupGone()
	deletes := e2e.CallsOn(s.Driver.Journal(), r, testdriver.MethodDeleteVolumeGroupSnapshot)
	if len(deletes) == 0 {
		t.Fatal("no DeleteVolumeGroupSnapshot")
	}
	for _, d := range deletes {
		if d.GroupSnapshotID != group.ID || !sameSet(d.SnapshotIDList(), group.SnapshotIDs) || d.Code != "OK" {
			t.Errorf("DeleteVolumeGroupSnapshot of %s with members %v ended %s, want %s with %v, OK", d.GroupSnapshotID, d.SnapshotIDList(), d.Code, group.ID, group.SnapshotIDs)
		}
	}
	if n := len(s.Driver.Calls(testdriver.MethodDeleteSnapshot)); n != 0 {
		t.Errorf("%d DeleteSnapshot calls: members go with their group only", n)
	}
	if o := s.Driver.Overlaps(); len(o) != 0 {
		t.Errorf("%d overlapping calls: %+v", len(o), o)
	}
	e2e.NoForbidden(t, r)
	// The sidecar itself ran under the cache mutation detector when the run asked for it.
	if os.Getenv("KUBE_CACHE_MUTATION_DETECTOR") == "true" && !strings.Contains(r.Stderr(), "Mutation detector is enabled") {
		t.Error("KUBE_CACHE_MUTATION_DETECTOR=true, but the sidecar ran without the cache mutation detector")
	}
}

// A group snapshot the driver reports not ready at first is asked again with
// CreateVolumeGroupSnapshot (upstream's rule; the same name gets the same group snapshot)
// until it is ready; its members, recorded not ready, are checked with ListSnapshots as
// soon as the snapshot-controller has written their first status (upstream waits for the
// next resync, 15 minutes by default; the default is kept here).
func TestVolumeGroupSnapshotNotReadyAtFirstIsPolledUntilReady(t *testing.T) {
	s := newScenario(t, testdriver.Config{SnapshotReadyAfterPolls: 1})
	claims := s.claims(2)
	s.labelClaims("db", claims...)
	class := s.groupClass(nil)
	r := s.start("replica-a")
	s.volumeGroupSnapshot("db", class, "db")
	s.waitGroupReady("db")
	creates := e2e.CallsOn(s.Driver.Journal(), r, testdriver.MethodCreateVolumeGroupSnapshot)
	if len(creates) < 2 {
		t.Errorf("%d CreateVolumeGroupSnapshot calls for a group snapshot ready at the second answer: readiness not polled", len(creates))
	}
	for _, c := range creates {
		if c.GroupSnapshotName != creates[0].GroupSnapshotName || c.Code != "OK" {
			t.Errorf("CreateVolumeGroupSnapshot %q ended %s, want %q, OK", c.GroupSnapshotName, c.Code, creates[0].GroupSnapshotName)
		}
	}
	if n := len(s.Driver.GroupSnapshots()); n != 1 {
		t.Errorf("backend holds %d group snapshots, want 1", n)
	}
	s.WaitUntil("the members' VolumeSnapshots ready", func() bool {
		vss := s.volumeSnapshots()
		for _, vs := range vss {
			if vs.Status == nil || !ptr.Deref(vs.Status.ReadyToUse, false) {
				return false
			}
		}
		return len(vss) == 2
	})
	if n := len(e2e.CallsOn(s.Driver.Journal(), r, testdriver.MethodListSnapshots)); n == 0 {
		t.Error("no ListSnapshots: the members were not checked")
	}
	s.deleteVolumeGroupSnapshot("db")
	s.waitGroupGone()
}

// labelClaims puts groupLabel=group on the claims.
func (s *scenario) labelClaims(group string, claims ...string) {
	s.T.Helper()
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{groupLabel: group}}})
	for _, c := range claims {
		if _, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Patch(s.ctx(), c, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			s.T.Fatal(err)
		}
	}
}

// volumeOf is the driver's volume id of a claim of claims.
func (s *scenario) volumeOf(claim string) string {
	s.T.Helper()
	pvc, err := s.Client.CoreV1().PersistentVolumeClaims(s.Namespace).Get(s.ctx(), claim, metav1.GetOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	pv, err := s.Client.CoreV1().PersistentVolumes().Get(s.ctx(), pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return pv.Spec.CSI.VolumeHandle
}

// groupClass creates the scenario's VolumeGroupSnapshotClass of the driver (policy Delete,
// tier=platinum and extra parameters) and returns its name.
func (s *scenario) groupClass(extra map[string]string) string {
	s.T.Helper()
	name := s.Namespace + "-group"
	params := map[string]string{"tier": "platinum"}
	maps.Copy(params, extra)
	class := &groupv1.VolumeGroupSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Driver: s.Driver.DriverName(),
		DeletionPolicy: snapv1.VolumeSnapshotContentDelete, Parameters: params}
	if _, err := s.snaps.GroupsnapshotV1().VolumeGroupSnapshotClasses().Create(s.ctx(), class, metav1.CreateOptions{}); err != nil {
		s.T.Fatal(err)
	}
	s.T.Cleanup(func() {
		_ = s.snaps.GroupsnapshotV1().VolumeGroupSnapshotClasses().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	return name
}

// volumeGroupSnapshot creates VolumeGroupSnapshot name of class, of the claims labelled
// groupLabel=group.
func (s *scenario) volumeGroupSnapshot(name, class, group string) *groupv1.VolumeGroupSnapshot {
	s.T.Helper()
	vgs, err := s.snaps.GroupsnapshotV1().VolumeGroupSnapshots(s.Namespace).Create(s.ctx(), &groupv1.VolumeGroupSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: groupv1.VolumeGroupSnapshotSpec{
			Source:                       groupv1.VolumeGroupSnapshotSource{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{groupLabel: group}}},
			VolumeGroupSnapshotClassName: &class,
		},
	}, metav1.CreateOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return vgs
}

func (s *scenario) deleteVolumeGroupSnapshot(name string) {
	s.T.Helper()
	if err := s.snaps.GroupsnapshotV1().VolumeGroupSnapshots(s.Namespace).Delete(s.ctx(), name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		s.T.Fatal(err)
	}
}

// volumeGroupSnapshots are the scenario's VolumeGroupSnapshots by name.
func (s *scenario) volumeGroupSnapshots() map[string]groupv1.VolumeGroupSnapshot {
	s.T.Helper()
	list, err := s.snaps.GroupsnapshotV1().VolumeGroupSnapshots(s.Namespace).List(s.ctx(), metav1.ListOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	out := map[string]groupv1.VolumeGroupSnapshot{}
	for _, g := range list.Items {
		out[g.Name] = g
	}
	return out
}

// groupContents are the driver's VolumeGroupSnapshotContents.
func (s *scenario) groupContents() []groupv1.VolumeGroupSnapshotContent {
	s.T.Helper()
	list, err := s.snaps.GroupsnapshotV1().VolumeGroupSnapshotContents().List(s.ctx(), metav1.ListOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	var out []groupv1.VolumeGroupSnapshotContent
	for _, c := range list.Items {
		if c.Spec.Driver == s.Driver.DriverName() {
			out = append(out, c)
		}
	}
	return out
}

func (s *scenario) groupContent(name string) *groupv1.VolumeGroupSnapshotContent {
	s.T.Helper()
	c, err := s.snaps.GroupsnapshotV1().VolumeGroupSnapshotContents().Get(s.ctx(), name, metav1.GetOptions{})
	if err != nil {
		s.T.Fatal(err)
	}
	return c
}

// waitGroupReady waits until VolumeGroupSnapshot name is ready to use and bound, and
// returns it. On a timeout it reports what the objects say.
func (s *scenario) waitGroupReady(name string) groupv1.VolumeGroupSnapshot {
	s.T.Helper()
	var vgs groupv1.VolumeGroupSnapshot
	ok := false
	defer func() {
		if !ok {
			s.T.Logf("VolumeGroupSnapshot %s: %s\ngroup contents: %s", name, dump(vgs), dump(s.groupContents()))
		}
	}()
	s.WaitUntil("VolumeGroupSnapshot "+name+" ready", func() bool {
		vgs = s.volumeGroupSnapshots()[name]
		return vgs.Status != nil && ptr.Deref(vgs.Status.ReadyToUse, false) && vgs.Status.BoundVolumeGroupSnapshotContentName != nil
	})
	ok = true
	return vgs
}

// waitGroupGone waits until no VolumeGroupSnapshot, group content, VolumeSnapshot or
// content of the scenario is left, and the backend holds no snapshot.
func (s *scenario) waitGroupGone() {
	s.T.Helper()
	ok := false
	defer func() {
		if !ok {
			s.T.Logf("left: VolumeGroupSnapshots %s\ngroup contents %s\nVolumeSnapshots %s\ncontents %s\nbackend groups %+v snapshots %+v",
				dump(s.volumeGroupSnapshots()), dump(s.groupContents()), dump(s.volumeSnapshots()), dump(s.contents()),
				s.Driver.GroupSnapshots(), s.Driver.Snapshots())
		}
	}()
	s.WaitUntil("the group snapshot, its members and their objects gone", func() bool {
		return len(s.Driver.GroupSnapshots()) == 0 && len(s.Driver.Snapshots()) == 0 &&
			len(s.volumeGroupSnapshots()) == 0 && len(s.groupContents()) == 0 &&
			len(s.volumeSnapshots()) == 0 && len(s.contents()) == 0
	})
	ok = true
}

// sameSet tells whether a and b hold the same strings, in any order.
func sameSet(a, b []string) bool {
	return slices.Equal(slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)))
}

// dump is v as JSON, for messages.
func dump(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return err.Error()
	}
	return strings.TrimSpace(string(b))
}
