#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager, kubeadm, kubelet, etcd and kubectl from the
# pinned Go module into target/control-plane/bin/. kube-controller-manager and kubeadm serve the
# lab's join-ready control plane (bootstrap tokens, cluster-info, CSR signing); kubeadm and kubelet
# also go into the lab's Debian image (hack/os-image), so its hosts join as real nodes.
# Skips the build when the binaries there were built from the same pin (go.mod + go.sum hash).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
bin="${CONTROL_PLANE_BIN:-$root/target/control-plane/bin}"
stamp="$bin/.pin"

command -v go >/dev/null || { echo "build.sh: Go is required to build the control plane (apt-get install golang-go, or a Go toolchain >= 1.26)" >&2; exit 1; }
want="$KUBERNETES_VERSION $(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && [ -x "$bin/kube-apiserver" ] && [ -x "$bin/etcd" ] && [ -x "$bin/kubectl" ] \
   && [ -x "$bin/kube-controller-manager" ] && [ -x "$bin/kubeadm" ] && [ -x "$bin/kubelet" ]; then
  echo "control plane: reusing cached build of Kubernetes $KUBERNETES_VERSION in $bin"
  exit 0
fi

echo "control plane: building Kubernetes $KUBERNETES_VERSION (kube-apiserver, kube-controller-manager, kubeadm, kubelet, etcd, kubectl) from the Go module proxy; a cold build takes several minutes"
mkdir -p "$bin"
cd "$here"
minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
etcd_version=$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
# Version stamping as Kubernetes' own hack/lib/version.sh does, so /version reports the pin.
kv() { for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  printf -- '-X %s.%s=%s ' "$pkg" "$1" "$2"; done; }
ldflags="-s -w $(kv gitVersion "$KUBERNETES_VERSION") $(kv gitMajor 1) $(kv gitMinor "$minor") $(kv gitTreeState clean) $(kv buildDate "$(date -u +%Y-%m-%dT%H:%M:%SZ)")"
start=$(date +%s)
export CGO_ENABLED=0 GOFLAGS=-mod=mod
go build -trimpath -ldflags "$ldflags" -o "$bin/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
go build -trimpath -ldflags "$ldflags" -o "$bin/kubectl" k8s.io/kubernetes/cmd/kubectl
go build -trimpath -ldflags "$ldflags" -o "$bin/kube-controller-manager" k8s.io/kubernetes/cmd/kube-controller-manager
go build -trimpath -ldflags "$ldflags" -o "$bin/kubeadm" k8s.io/kubernetes/cmd/kubeadm
# Static, as Kubernetes' own release builds it (CGO off): it runs on the lab's Debian as is.
go build -trimpath -ldflags "$ldflags" -o "$bin/kubelet" k8s.io/kubernetes/cmd/kubelet
go build -trimpath -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=${etcd_version}" -o "$bin/etcd" go.etcd.io/etcd/server/v3
echo "$want" > "$stamp"
echo "control plane: built Kubernetes $KUBERNETES_VERSION and etcd $etcd_version in $(( $(date +%s) - start ))s"
