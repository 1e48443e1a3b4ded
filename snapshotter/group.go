package snapshotter

import (
	"context"
	"time"

	"k8s.io/client-go/tools/record"

	"github.com/csi-sidecars/csi-sidecars/lifecycle"
)

type groupConfig struct {
	clients      *clients
	driver       *driver
	recorder     record.EventRecorder
	resync       time.Duration
	retryStart   time.Duration
	retryMax     time.Duration
	backlog      *lifecycle.Backlog
	namePrefix   string
	nameUUIDSize int
}

// groupController takes and deletes the driver's volume group snapshots.
type groupController struct {
	groupConfig
}

func newGroupController(cfg groupConfig) (*groupController, error) {
	return &groupController{groupConfig: cfg}, nil
}

func (g *groupController) run(intake, ops context.Context, workers int) {
	<-intake.Done()
}
