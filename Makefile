# csi-sidecars: build, test and run locally. `make help` lists the targets.
SHELL := /usr/bin/env bash
GO ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
BIN := _output/bin
# Integration and end-to-end packages each start a kube-apiserver + etcd and mostly wait on
# them and on the processes they run, so several run at once even on a 2-core machine.
TEST_FLAGS ?= -count=1 -p 3 -timeout 40m
# The packages whose tests need a control plane, a built binary or upstream's sources; the
# product's own packages hold unit tests only, which the race stage runs.
INTEGRATION_PKGS := ./cmd/... ./internal/... ./hack/... ./test/...

.PHONY: help demo bench build image test test-race test-integration test-image test-unit test-e2e testenv lint clean

# Tests run with client-go's cache mutation detector: an informer's cached object changed in
# place (the caches share strings and maps between objects) fails them.
test test-race test-integration test-unit test-e2e: export KUBE_CACHE_MUTATION_DETECTOR := true

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

demo: build testenv ## the main job, live under the real control loop (kube-controller-manager, scheduler): 2 replicas per sidecar, SIGTERM each leader mid-flight, a summary table
	$(GO) run ./test/demo --bin $(BIN)/csi-sidecars $(DEMO_FLAGS)

build: ## build the csi-sidecars binary and the test CSI driver into _output/bin
	CGO_ENABLED=0 $(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN)/csi-sidecars ./cmd/csi-sidecars
	$(GO) build -o $(BIN)/csi-test-driver ./internal/testkit/testdriver/csi-test-driver

# The image is built by hack/image with go-containerregistry, with no container engine and no
# base image to pull (the CI machines have neither), and `make test-image` reads back what it
# builds. There is no Dockerfile route: a second definition of the same image that no test
# builds would drift from this one, and its base would be pulled unpinned at build time.
image: ## build the multi-arch image (linux/amd64, linux/arm64) into _output/image, an OCI layout; IMAGE_FLAGS=--push=REF also pushes it
	$(GO) -C hack/image run . --source $(CURDIR) --output $(CURDIR)/_output/image --version $(VERSION) $(IMAGE_FLAGS)

testenv: ## build etcd, kube-apiserver, kube-controller-manager, kube-scheduler and hollow-kubelet once per machine into the cache (no-op when cached)
	@hack/control-plane.sh

bench: testenv ## benchmarks: failover figures, peak memory and the real control loop (latency, goodput, writes per operation) vs upstream, printed, never asserted
	$(GO) test -count=1 -run '^$$' -bench CachedObjectBytes -benchtime 1x ./lifecycle/cached
	$(GO) test -count=1 -p 1 -timeout 60m -run '^$$' -bench . -benchtime 1x ./test/...

lint: ## gofmt and go vet
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt wants to change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) -C hack/image vet ./...

test: lint testenv ## lint, then at once the race detector over the unit tests and every integration and end-to-end test against a real local control plane (ends with the ten slowest tests), and the image's test
	$(MAKE) --no-print-directory -j2 --output-sync=line test-race test-integration test-image

test-integration: ## the tests that need a control plane or built binaries (and the test kit's own), then the ten slowest tests
	set -o pipefail; $(GO) test -json $(TEST_FLAGS) $(INTEGRATION_PKGS) | $(GO) run ./hack/testreport -slowest 10

# The race stage runs the unit tests of the product and the test kit; the end-to-end packages
# under test/ skip in -short (their processes are not built with -race), and building each
# with -race only to skip took minutes. Those that host sidecars in the test process run.
test-race: ## the race detector over the unit tests and the tests that host sidecars in the test process
	$(GO) test -race -count=1 -short -p 2 $$($(GO) list ./... | grep -v '/test/')
	$(GO) test -race -count=1 -run 'OneProcess|OneFenced' ./test/e2e/

# Its own module's (hack/image); it needs no control plane and starts once a stage above ends.
# About 30 s with the build cache warm; cold, the two cross builds of every dependency take
# minutes (over ten on a loaded 2-core machine), hence the timeout.
test-image: ## build the image once as `make image` does, push it to a registry on loopback, and read it back: platforms, static binaries, user, entrypoint, version
	$(GO) -C hack/image test -count=1 -timeout 30m ./...

test-unit: ## fast tests only (no control plane)
	$(GO) test -count=1 -short ./...

test-e2e: testenv ## end-to-end tests: built binaries as processes, real apiserver, test CSI driver
	$(GO) test $(TEST_FLAGS) -v ./test/e2e/...

clean: ## remove build outputs (the control-plane cache stays)
	rm -rf _output
