#!/usr/bin/env bash
# Builds kube-apiserver, etcd and kustomize from Go modules into a per-machine cache, once.
# Prints the folder that holds the binaries. Reuses what is present.
set -euo pipefail
K8S_VERSION=v1.37.2
KUSTOMIZE_VERSION=v5.8.1
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
if [ ! -x "$dir/kustomize" ]; then
  echo "building kustomize into $dir (about 1 min)" >&2
  GOBIN="$dir" go install sigs.k8s.io/kustomize/kustomize/v5@${KUSTOMIZE_VERSION}
fi
echo "$dir"
