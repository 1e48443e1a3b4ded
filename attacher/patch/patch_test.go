package patch

import (
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestVolumeError(t *testing.T) {
	now := metav1.Now()
	if ve := volumeError(status.Error(codes.NotFound, "gone"), true, now); ve.ErrorCode == nil || *ve.ErrorCode != 5 || ve.Message != "rpc error: code = NotFound desc = gone" {
		t.Errorf("%+v", ve)
	}
	if ve := volumeError(fmt.Errorf("plain"), true, now); ve.ErrorCode != nil && *ve.ErrorCode != int32(codes.Unknown) {
		t.Errorf("non-gRPC error: %+v", ve)
	}
	if ve := volumeError(status.Error(codes.NotFound, "gone"), false, now); ve.ErrorCode != nil {
		t.Errorf("gate off: %+v", ve)
	}
}
