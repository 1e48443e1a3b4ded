package healthmonitor

import (
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	v1 "k8s.io/api/core/v1"
)

// Bounds of PersistentVolumeClaim status.healthStatus (k8s.io/api v0.37 validation).
const (
	maxConditions    = 16
	maxReasonBytes   = 256
	maxMessageBytes  = 1024
	truncationSuffix = "..."
)

// conditionsOf maps the adverse conditions a driver reports for a volume onto the claim's
// health conditions: DEGRADED, INACCESSIBLE and DATA_LOSS become Degraded, Inaccessible
// and DataLoss. A type the Kubernetes API has no value for (UNKNOWN_VOLUME_HEALTH_TYPE, or
// one of a newer spec) is left out, as the spec lets a CO that does not know it: it is
// returned in unknown for the log. The result is sorted by status and reason, holds each
// (status, reason) once and at most maxConditions entries, with reasons and messages cut to
// the API's limits; nil means healthy.
func conditionsOf(entries []*csi.VolumeHealth_VolumeHealthEntry) (conds []v1.VolumeHealthCondition, unknown []string) {
	seen := map[[2]string]bool{}
	for _, e := range entries {
		st, ok := statusOf(e.GetStatus())
		if !ok {
			unknown = append(unknown, fmt.Sprintf("%s/%s", e.GetStatus(), e.GetReason()))
			continue
		}
		reason := truncate(e.GetReason(), maxReasonBytes)
		if reason == "" {
			// The spec requires a reason and the API too: the status names the condition.
			reason = string(st)
		}
		k := [2]string{string(st), reason}
		if seen[k] {
			continue
		}
		seen[k] = true
		conds = append(conds, v1.VolumeHealthCondition{Status: st, Reason: reason, Message: truncate(e.GetMessage(), maxMessageBytes)})
	}
	slices.SortFunc(conds, func(a, b v1.VolumeHealthCondition) int {
		if c := strings.Compare(string(a.Status), string(b.Status)); c != 0 {
			return c
		}
		return strings.Compare(a.Reason, b.Reason)
	})
	if len(conds) > maxConditions {
		conds = conds[:maxConditions]
	}
	return conds, unknown
}

func statusOf(t csi.VolumeHealthErrorType) (v1.VolumeHealthStatusType, bool) {
	switch t {
	case csi.VolumeHealthErrorType_DEGRADED:
		return v1.VolumeHealthDegraded, true
	case csi.VolumeHealthErrorType_INACCESSIBLE:
		return v1.VolumeHealthInaccessible, true
	case csi.VolumeHealthErrorType_DATA_LOSS:
		return v1.VolumeHealthDataLoss, true
	}
	return "", false
}

// truncate cuts s to at most n bytes on a rune boundary, marking the cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n - len(truncationSuffix)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + truncationSuffix
}

// sameConditions tells whether two condition lists hold the same conditions, messages
// included, in any order.
func sameConditions(a, b []v1.VolumeHealthCondition) bool {
	return slices.Equal(sortedCopy(a), sortedCopy(b))
}

// sameSet tells whether two condition lists name the same (status, reason) pairs: only
// then does a claim's lastTransitionTime stay.
func sameSet(a, b []v1.VolumeHealthCondition) bool {
	strip := func(cs []v1.VolumeHealthCondition) []v1.VolumeHealthCondition {
		out := sortedCopy(cs)
		for i := range out {
			out[i].Message = ""
		}
		return out
	}
	return slices.Equal(strip(a), strip(b))
}

func sortedCopy(cs []v1.VolumeHealthCondition) []v1.VolumeHealthCondition {
	out := slices.Clone(cs)
	slices.SortFunc(out, func(a, b v1.VolumeHealthCondition) int {
		if c := strings.Compare(string(a.Status), string(b.Status)); c != 0 {
			return c
		}
		if c := strings.Compare(a.Reason, b.Reason); c != 0 {
			return c
		}
		return strings.Compare(a.Message, b.Message)
	})
	return out
}

// eventMessage is the message of a VolumeConditionAbnormal event: upstream's event carries
// the driver's one message; here each condition is named with its message.
func eventMessage(conds []v1.VolumeHealthCondition) string {
	parts := make([]string, 0, len(conds))
	for _, c := range conds {
		p := string(c.Status) + " (" + c.Reason + ")"
		if c.Message != "" {
			p += ": " + c.Message
		}
		parts = append(parts, p)
	}
	return strings.Join(parts, "; ")
}
