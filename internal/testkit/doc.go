// Package testkit holds, in its sub-packages, what tests csi-sidecars and nothing of the
// product: a real CSI driver for tests (testdriver), a local control plane (controlplane:
// kube-apiserver and etcd; cluster: kube-controller-manager and kube-scheduler;
// snapshotcontroller; kubelet: the real kubelet with a fake container runtime), the
// end-to-end harness that runs replicas as processes (e2e), a sidecar made for lifecycle
// tests (testsidecar), upstream's releases built for comparison (upstream), a model of upstream's
// node-driver-registrar, which cannot be built here (upstreamregistrar), the API
// server's audit log (audit), and helpers of unit tests (cachetest, draintest, logtest).
package testkit
