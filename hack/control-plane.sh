#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager, kube-scheduler, etcd, hollow-kubelet (the
# kubelet with kubemark's fake runtime, see tools/hollow-kubelet), kustomize and the
# snapshot-controller of external-snapshotter from Go modules into a per-machine cache, once.
# Prints the folder that holds the binaries. Reuses what is present.
set -euo pipefail
K8S_VERSION=v1.37.2
KUSTOMIZE_VERSION=v5.8.1
# Pinned in hack/snapshot-controller/go.mod, a module of its own (see there why).
SNAPSHOTTER_VERSION=v8.7.0
here=$(cd "$(dirname "$0")" && pwd)
dir=${CSI_SIDECARS_ASSETS:-${XDG_CACHE_HOME:-$HOME/.cache}/csi-sidecars/k8s-${K8S_VERSION}}
mkdir -p "$dir"
cd "$here/tools"
if [ ! -x "$dir/etcd" ]; then
  echo "building etcd into $dir (about 1 min)" >&2
  go build -o "$dir/etcd.tmp" go.etcd.io/etcd/server/v3
  mv "$dir/etcd.tmp" "$dir/etcd"
fi
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
ldflags="-s -w \
  -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} \
  -X k8s.io/component-base/version.gitMajor=1 \
  -X k8s.io/component-base/version.gitMinor=${minor} \
  -X k8s.io/client-go/pkg/version.gitVersion=${K8S_VERSION}"
# kube-apiserver first (10-18 min cold); kube-controller-manager and kube-scheduler reuse its
# build cache (a few minutes more).
for cmd in kube-apiserver kube-controller-manager kube-scheduler; do
  if [ ! -x "$dir/$cmd" ]; then
    echo "building $cmd into $dir" >&2
    go build -o "$dir/$cmd.tmp" -ldflags "$ldflags" "k8s.io/kubernetes/cmd/$cmd"
    mv "$dir/$cmd.tmp" "$dir/$cmd"
  fi
done
# hollow-kubelet is our own program: rebuilt when its source or the module changes, which
# the stamp beside it records.
hollow_sum=$(cat hollow-kubelet/*.go go.mod go.sum | sha256sum | cut -d' ' -f1)
if [ ! -x "$dir/hollow-kubelet" ] || [ "$(cat "$dir/hollow-kubelet.sum" 2>/dev/null)" != "$hollow_sum" ]; then
  echo "building hollow-kubelet into $dir (1-2 min after kube-controller-manager: it adds about 120 packages)" >&2
  go build -o "$dir/hollow-kubelet.tmp" -ldflags "$ldflags" ./hollow-kubelet
  mv "$dir/hollow-kubelet.tmp" "$dir/hollow-kubelet"
  echo "$hollow_sum" > "$dir/hollow-kubelet.sum"
fi
if [ ! -x "$dir/kustomize" ]; then
  echo "building kustomize into $dir (about 1 min)" >&2
  GOBIN="$dir" go install sigs.k8s.io/kustomize/kustomize/v5@${KUSTOMIZE_VERSION}
fi
if [ ! -x "$dir/snapshot-controller" ]; then
  echo "building snapshot-controller ${SNAPSHOTTER_VERSION} into $dir (about 8 min cold on 2 cores)" >&2
  (cd "$here/snapshot-controller" &&
    go build -o "$dir/snapshot-controller.tmp" -ldflags "-s -w -X main.version=${SNAPSHOTTER_VERSION}" \
      github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller)
  mv "$dir/snapshot-controller.tmp" "$dir/snapshot-controller"
fi
echo "$dir"
