package resizer

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// claimState builds a bound PVC: request, status capacity, allocatedResources ("" for
// none), the storage resize status, and an optional FileSystemResizePending condition.
func claimState(request, capacity, allocated string, state v1.ClaimResourceStatus, fsPending bool) *v1.PersistentVolumeClaim {
	pvc := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "claim", UID: "uid-claim"},
		Spec: v1.PersistentVolumeClaimSpec{
			VolumeName: "pv",
			Resources:  v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse(request)}},
		},
		Status: v1.PersistentVolumeClaimStatus{Phase: v1.ClaimBound, Capacity: v1.ResourceList{v1.ResourceStorage: resource.MustParse(capacity)}},
	}
	if allocated != "" {
		pvc.Status.AllocatedResources = v1.ResourceList{v1.ResourceStorage: resource.MustParse(allocated)}
	}
	if state != "" {
		pvc.Status.AllocatedResourceStatuses = map[v1.ResourceName]v1.ClaimResourceStatus{v1.ResourceStorage: state}
	}
	if fsPending {
		pvc.Status.Conditions = []v1.PersistentVolumeClaimCondition{{Type: v1.PersistentVolumeClaimFileSystemResizePending, Status: v1.ConditionTrue}}
	}
	return pvc
}

func volumeOf(size string) *v1.PersistentVolume {
	return &v1.PersistentVolume{Spec: v1.PersistentVolumeSpec{Capacity: v1.ResourceList{v1.ResourceStorage: resource.MustParse(size)}}}
}

// Which size each state of a PVC leads to (RecoverVolumeExpansionFailure).
func TestPlanExpansion(t *testing.T) {
	const (
		inProgress = v1.PersistentVolumeClaimControllerResizeInProgress
		infeasible = v1.PersistentVolumeClaimControllerResizeInfeasible
		nodePend   = v1.PersistentVolumeClaimNodeResizePending
		nodeProg   = v1.PersistentVolumeClaimNodeResizeInProgress
		nodeInfeas = v1.PersistentVolumeClaimNodeResizeInfeasible
	)
	for _, tc := range []struct {
		name              string
		pvc               *v1.PersistentVolumeClaim
		pv                string
		controllerExpands bool
		finalError        bool
		wantWait          bool
		wantSize          string
		wantSame          bool
	}{
		{name: "first request", pvc: claimState("2Gi", "1Gi", "", "", false), pv: "1Gi", controllerExpands: true, wantSize: "2Gi"},
		{name: "retry after an uncertain error keeps the allocated size", pvc: claimState("2Gi", "1Gi", "3Gi", inProgress, false), pv: "1Gi", controllerExpands: true, wantSize: "3Gi", wantSame: true},
		{name: "request lowered after a final error takes the request", pvc: claimState("2Gi", "1Gi", "3Gi", inProgress, false), pv: "1Gi", controllerExpands: true, finalError: true, wantSize: "2Gi"},
		{name: "request lowered after infeasible takes the request (recovery)", pvc: claimState("2Gi", "1Gi", "10Gi", infeasible, false), pv: "1Gi", controllerExpands: true, wantSize: "2Gi"},
		{name: "same request after infeasible", pvc: claimState("10Gi", "1Gi", "10Gi", infeasible, false), pv: "1Gi", controllerExpands: true, wantSize: "10Gi", wantSame: true},
		{name: "node pending, PV covers allocation: wait", pvc: claimState("3Gi", "1Gi", "2Gi", nodePend, false), pv: "2Gi", controllerExpands: true, wantWait: true},
		{name: "node in progress, PV covers allocation: wait", pvc: claimState("3Gi", "1Gi", "2Gi", nodeProg, false), pv: "2Gi", controllerExpands: true, wantWait: true},
		{name: "node pending but PV short of allocation: resume allocation", pvc: claimState("3Gi", "1Gi", "2Gi", nodePend, false), pv: "1Gi", controllerExpands: true, wantSize: "2Gi", wantSame: true},
		{name: "node infeasible, PV short: allocation", pvc: claimState("3Gi", "1Gi", "2Gi", nodeInfeas, false), pv: "1Gi", controllerExpands: true, wantSize: "2Gi", wantSame: true},
		{name: "PV expanded, node pending: wait", pvc: claimState("2Gi", "1Gi", "2Gi", nodePend, false), pv: "2Gi", controllerExpands: true, wantWait: true},
		{name: "PV expanded but not recorded: finish at allocation", pvc: claimState("2Gi", "1Gi", "2Gi", inProgress, false), pv: "2Gi", controllerExpands: true, wantSize: "2Gi", wantSame: true},
		{name: "PV expanded, node infeasible, controller driver: allocation", pvc: claimState("2Gi", "1Gi", "3Gi", nodeInfeas, false), pv: "3Gi", controllerExpands: true, wantSize: "3Gi", wantSame: true},
		{name: "PV expanded, node infeasible, node-only driver: request", pvc: claimState("2Gi", "1Gi", "3Gi", nodeInfeas, false), pv: "3Gi", wantSize: "2Gi"},
		{name: "PV expanded, no status, allocation known", pvc: claimState("2Gi", "1Gi", "2Gi", "", false), pv: "2Gi", controllerExpands: true, wantSize: "2Gi", wantSame: true},
		{name: "PV expanded, old API server with FileSystemResizePending: wait", pvc: claimState("2Gi", "1Gi", "", "", true), pv: "2Gi", controllerExpands: true, wantWait: true},
		{name: "PV expanded, nothing recorded: request", pvc: claimState("2Gi", "1Gi", "", "", false), pv: "2Gi", controllerExpands: true, wantSize: "2Gi"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := planExpansion(tc.pvc, volumeOf(tc.pv), tc.controllerExpands, tc.finalError)
			if got.wait != tc.wantWait {
				t.Fatalf("wait = %v, want %v", got.wait, tc.wantWait)
			}
			if tc.wantWait {
				return
			}
			if got.size.Cmp(resource.MustParse(tc.wantSize)) != 0 || got.sameAsAllocated != tc.wantSame {
				t.Errorf("size %s sameAsAllocated %v, want %s %v", got.size.String(), got.sameAsAllocated, tc.wantSize, tc.wantSame)
			}
		})
	}
}

// Repeating a status step changes nothing, so no write is sent.
func TestStatusStepsAreIdempotent(t *testing.T) {
	pvc := claimState("2Gi", "1Gi", "", "", false)
	plan := planExpansion(pvc, volumeOf("1Gi"), true, false)
	once := markInProgress(pvc, plan)
	again := markInProgress(once, planExpansion(once, volumeOf("1Gi"), true, false))
	if p, err := twoWayPatch(once, again, &v1.PersistentVolumeClaim{}, true, "1"); err != nil || p != nil {
		t.Errorf("marking in progress twice: patch %s, err %v; want none", p, err)
	}
	failed := markFailed(once, errTest("boom"), false)
	if p, _ := twoWayPatch(failed, markFailed(failed, errTest("boom"), false), &v1.PersistentVolumeClaim{}, false, ""); p != nil {
		t.Errorf("recording the same failure twice: patch %s, want none", p)
	}
	if p, _ := twoWayPatch(once, markFinished(once, resource.MustParse("2Gi")), &v1.PersistentVolumeClaim{}, true, "7"); p == nil {
		t.Errorf("finishing: want a patch")
	}
}

type errTest string

func (e errTest) Error() string { return string(e) }
