#!/usr/bin/env bash
# Builds kube-apiserver and etcd from Go modules into a per-machine cache, once.
# Prints the folder that holds both binaries. Reuses it when both are present.
set -euo pipefail
K8S_VERSION=v1.37.2
here=$(cd "$(dirname "$0")" && pwd)
dir=${CSI_SIDECARS_ASSETS:-${XDG_CACHE_HOME:-$HOME/.cache}/csi-sidecars/k8s-${K8S_VERSION}}
mkdir -p "$dir"
cd "$here/tools"
if [ ! -x "$dir/etcd" ]; then
  echo "building etcd into $dir (about 1 min)" >&2
  go build -o "$dir/etcd.tmp" go.etcd.io/etcd/server/v3
  mv "$dir/etcd.tmp" "$dir/etcd"
fi
if [ ! -x "$dir/kube-apiserver" ]; then
  echo "building kube-apiserver into $dir (10-18 min cold)" >&2
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  go build -o "$dir/kube-apiserver.tmp" -ldflags "-s -w \
    -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} \
    -X k8s.io/component-base/version.gitMajor=1 \
    -X k8s.io/component-base/version.gitMinor=${minor} \
    -X k8s.io/client-go/pkg/version.gitVersion=${K8S_VERSION}" \
    k8s.io/kubernetes/cmd/kube-apiserver
  mv "$dir/kube-apiserver.tmp" "$dir/kube-apiserver"
fi
echo "$dir"
