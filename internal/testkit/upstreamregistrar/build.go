package upstreamregistrar

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// Command is the model's command, a package path below the repository root.
const Command = "./internal/testkit/upstreamregistrar/upstream-registrar"

// Build builds the model's command into dir and returns the binary's path. root is the
// repository root.
func Build(ctx context.Context, root, dir string) (string, error) {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", dir, Command)
	cmd.Dir = root
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("building %s: %w", Command, err)
	}
	return filepath.Join(dir, filepath.Base(Command)), nil
}
