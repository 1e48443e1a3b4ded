package resizer

import (
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// needsExpansion tells whether a PVC asks for more than it has: it is bound and its
// request exceeds its status capacity.
func needsExpansion(pvc *v1.PersistentVolumeClaim) bool {
	if pvc.Status.Phase != v1.ClaimBound || pvc.Spec.VolumeName == "" {
		return false
	}
	request := pvc.Spec.Resources.Requests[v1.ResourceStorage]
	capacity := pvc.Status.Capacity[v1.ResourceStorage]
	return request.Cmp(capacity) > 0
}

// expansion is what one sync does about a PVC that needs expansion.
type expansion struct {
	// wait: nothing to do now (the node is expanding, or the PV already covers the size).
	wait bool
	// size is what to ask the driver for.
	size resource.Quantity
	// sameAsAllocated: size is already recorded in allocatedResources, so the status
	// need not be reset to ControllerResizeInProgress (upstream's updateStatus=false).
	sameAsAllocated bool
}

// planExpansion decides, with RecoverVolumeExpansionFailure, which size to expand a PVC's
// volume to. It resumes an operation that may still run in the driver at the size recorded
// in allocatedResources, and only takes the (possibly lowered) request when the previous
// attempt certainly ended: finalError says the last controller call of this PVC ended with a
// final error. controllerExpands is false for the trivial resizer.
func planExpansion(pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume, controllerExpands, finalError bool) expansion {
	request := pvc.Spec.Resources.Requests[v1.ResourceStorage]
	pvSize := pv.Spec.Capacity[v1.ResourceStorage]
	state := pvc.Status.AllocatedResourceStatuses[v1.ResourceStorage]
	allocated, hasAllocated := pvc.Status.AllocatedResources[v1.ResourceStorage]
	orAllocated := func() resource.Quantity {
		if hasAllocated {
			return allocated
		}
		return request
	}

	size := request
	if pvSize.Cmp(request) < 0 {
		// The volume is smaller than asked: expand, but let an earlier operation finish first.
		switch state {
		case v1.PersistentVolumeClaimNodeResizeInfeasible:
			size = orAllocated()
		case v1.PersistentVolumeClaimNodeResizePending, v1.PersistentVolumeClaimNodeResizeInProgress:
			size = orAllocated()
			if pvSize.Cmp(size) >= 0 {
				// The node still has to catch up with what the controller did.
				return expansion{wait: true}
			}
		case v1.PersistentVolumeClaimControllerResizeInProgress:
			// The last attempt may still be running in the driver unless it ended with a
			// final error: only then may the size change.
			if !finalError {
				size = orAllocated()
			}
		default:
			// Nothing in flight, or the last size was infeasible: take the request,
			// which the user may have lowered (the recovery).
		}
	} else {
		// The volume has the size already: the status may not say so yet.
		switch state {
		case v1.PersistentVolumeClaimNodeResizeInProgress, v1.PersistentVolumeClaimNodeResizePending:
			return expansion{wait: true}
		case v1.PersistentVolumeClaimNodeResizeInfeasible:
			// Reset so that the kubelet may retry: a controller re-expands to what it
			// allocated, a node-only driver to the request.
			if controllerExpands {
				size = orAllocated()
			}
		case v1.PersistentVolumeClaimControllerResizeInProgress, v1.PersistentVolumeClaimControllerResizeInfeasible:
			// Expanded but not recorded, or the request was lowered after expanding.
			size = orAllocated()
		default:
			switch {
			case hasAllocated:
				size = allocated
			case hasFileSystemResizePending(pvc):
				return expansion{wait: true}
			}
		}
	}
	return expansion{size: size, sameAsAllocated: hasAllocated && allocated.Cmp(size) == 0}
}

func hasFileSystemResizePending(pvc *v1.PersistentVolumeClaim) bool {
	for _, c := range pvc.Status.Conditions {
		if c.Type == v1.PersistentVolumeClaimFileSystemResizePending && c.Status == v1.ConditionTrue {
			return true
		}
	}
	return false
}

// nodeCaughtUp tells whether the PVC's capacity reached the PV's: the node finished its part.
func nodeCaughtUp(pvc *v1.PersistentVolumeClaim, pv *v1.PersistentVolume) bool {
	pvcSize := pvc.Status.Capacity[v1.ResourceStorage]
	pvSize := pv.Spec.Capacity[v1.ResourceStorage]
	return pvcSize.Cmp(pvSize) >= 0
}

// resizeConditions are the PVC conditions the resize owns.
func isResizeCondition(t v1.PersistentVolumeClaimConditionType) bool {
	switch t {
	case v1.PersistentVolumeClaimResizing, v1.PersistentVolumeClaimFileSystemResizePending,
		v1.PersistentVolumeClaimControllerResizeError, v1.PersistentVolumeClaimNodeResizeError:
		return true
	}
	return false
}

// Status changes of a resize, each a pure function from the current PVC to the one to
// record, with the fields of the recovery from expansion failures (allocatedResources,
// allocatedResourceStatuses), always on since upstream v2.3.0.

// markInProgress: Resizing before the driver is called, with the size it will be asked for
// recorded in allocatedResources first, so a lowered request never loses track of what the
// driver may be doing.
func markInProgress(pvc *v1.PersistentVolumeClaim, e expansion) *v1.PersistentVolumeClaim {
	out := pvc.DeepCopy()
	conds := out.Status.Conditions
	if !e.sameAsAllocated {
		// A new attempt: earlier outcomes no longer apply.
		conds = dropConditions(conds, isResizeCondition)
	}
	out.Status.Conditions = setCondition(conds, newCondition(v1.PersistentVolumeClaimResizing, ""))
	delete(out.Annotations, annNodeExpansionNotRequired)
	if !e.sameAsAllocated {
		setResizeStatus(out, v1.PersistentVolumeClaimControllerResizeInProgress)
	}
	if out.Status.AllocatedResources == nil {
		out.Status.AllocatedResources = v1.ResourceList{}
	}
	out.Status.AllocatedResources[v1.ResourceStorage] = e.size
	return out
}

// markNodePending: the controller part is done, the kubelet must grow the file system.
func markNodePending(pvc *v1.PersistentVolumeClaim) *v1.PersistentVolumeClaim {
	out := pvc.DeepCopy()
	out.Status.Conditions = setCondition(out.Status.Conditions, newCondition(v1.PersistentVolumeClaimFileSystemResizePending,
		"Waiting for user to (re-)start a pod to finish file system resize of volume on node."))
	delete(out.Annotations, annNodeExpansionNotRequired)
	setResizeStatus(out, v1.PersistentVolumeClaimNodeResizePending)
	return out
}

// markFinished: the volume has size and nothing is left for the node.
func markFinished(pvc *v1.PersistentVolumeClaim, size resource.Quantity) *v1.PersistentVolumeClaim {
	out := pvc.DeepCopy()
	if out.Status.Capacity == nil {
		out.Status.Capacity = v1.ResourceList{}
	}
	out.Status.Capacity[v1.ResourceStorage] = size
	out.Status.Conditions = dropConditions(out.Status.Conditions, isResizeCondition)
	delete(out.Status.AllocatedResourceStatuses, v1.ResourceStorage)
	if len(out.Status.AllocatedResourceStatuses) == 0 {
		out.Status.AllocatedResourceStatuses = nil
	}
	if out.Annotations == nil {
		out.Annotations = map[string]string{}
	}
	out.Annotations[annNodeExpansionNotRequired] = "true"
	return out
}

// markFailed: the controller call ended with a final error; infeasible ones are recorded
// as ControllerResizeInfeasible so the user may lower the request.
func markFailed(pvc *v1.PersistentVolumeClaim, err error, infeasible bool) *v1.PersistentVolumeClaim {
	out := pvc.DeepCopy()
	out.Status.Conditions = setCondition(out.Status.Conditions, newCondition(v1.PersistentVolumeClaimControllerResizeError,
		"failed to expand pvc with "+err.Error()))
	if infeasible {
		setResizeStatus(out, v1.PersistentVolumeClaimControllerResizeInfeasible)
	}
	return out
}

func setResizeStatus(pvc *v1.PersistentVolumeClaim, s v1.ClaimResourceStatus) {
	if pvc.Status.AllocatedResourceStatuses == nil {
		pvc.Status.AllocatedResourceStatuses = map[v1.ResourceName]v1.ClaimResourceStatus{}
	}
	pvc.Status.AllocatedResourceStatuses[v1.ResourceStorage] = s
}

// withCapacity is the PV after the controller expansion: its new capacity and, when the
// node must still expand and AnnotateFsResize is on, the capacity before the resize (kept if
// an earlier attempt recorded it already).
func withCapacity(pv *v1.PersistentVolume, size, before resource.Quantity, nodeExpansion, annotate bool) *v1.PersistentVolume {
	out := pv.DeepCopy()
	if out.Spec.Capacity == nil {
		out.Spec.Capacity = v1.ResourceList{}
	}
	out.Spec.Capacity[v1.ResourceStorage] = size
	if annotate && nodeExpansion {
		if _, ok := out.Annotations[annPreResizeCapacity]; !ok {
			if out.Annotations == nil {
				out.Annotations = map[string]string{}
			}
			out.Annotations[annPreResizeCapacity] = before.String()
		}
	}
	return out
}
