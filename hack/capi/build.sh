#!/usr/bin/env bash
# Builds upstream Cluster API (core manager, kubeadm bootstrap manager, clusterctl) at the pinned
# release from the Go module proxy into target/capi/<version>/bin, and renders each provider's
# components from the release's own kustomize bases into target/capi/<version>/components, so that
# clusterctl can install them from a local repository. Cached: a second run is a no-op.
#
# The build uses upstream's own go.mod/go.sum. Its `replace sigs.k8s.io/cluster-api/api => ./api`
# points inside the repository, which module zips leave out (a nested module), so the published
# sigs.k8s.io/cluster-api/api module of the same version is put there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
out="${CAPI_DIR:-$root/target/capi/$CAPI_VERSION}"
bin="$out/bin"
stamp="$out/.built"
kubectl="${KUBECTL:-$root/target/control-plane/bin/kubectl}"

if [ -f "$stamp" ] && [ -x "$bin/clusterctl" ] && [ -x "$bin/capi-manager" ] \
   && [ -x "$bin/kubeadm-bootstrap-manager" ] && [ -f "$out/cert-manager-crds/VERSION" ]; then
  echo "capi: reusing cached Cluster API $CAPI_VERSION in $out"
  exit 0
fi
command -v go >/dev/null || { echo "capi/build.sh: Go is required" >&2; exit 1; }
[ -x "$kubectl" ] || { echo "capi/build.sh: no kubectl at $kubectl (run hack/control-plane/build.sh first)" >&2; exit 1; }

echo "capi: building Cluster API $CAPI_VERSION (core, kubeadm bootstrap, clusterctl) from the Go module proxy; a cold build takes several minutes"
start=$(date +%s)
src_dir=$(go mod download -json "sigs.k8s.io/cluster-api@$CAPI_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
api_dir=$(go mod download -json "sigs.k8s.io/cluster-api/api@$CAPI_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
[ -d "$src_dir" ] && [ -d "$api_dir" ] || { echo "capi/build.sh: could not download sigs.k8s.io/cluster-api@$CAPI_VERSION" >&2; exit 1; }
src="$out/src"
rm -rf "$src"; mkdir -p "$src" "$bin"
cp -r "$src_dir/." "$src/"; cp -r "$api_dir" "$src/api"; chmod -R u+w "$src"

minor=${CAPI_VERSION#v1.}; minor=${minor%%.*}
v=sigs.k8s.io/cluster-api/version
ldflags="-s -w -X $v.gitVersion=$CAPI_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean -X $v.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
cd "$src"
export CGO_ENABLED=0
go build -trimpath -ldflags "$ldflags" -o "$bin/clusterctl" ./cmd/clusterctl
go build -trimpath -ldflags "$ldflags" -o "$bin/capi-manager" ./core
go build -trimpath -ldflags "$ldflags" -o "$bin/kubeadm-bootstrap-manager" ./bootstrap/kubeadm

# Components as a release would publish them (clusterctl's local repository layout:
# <provider>/<version>/<components file> + metadata.yaml).
render() { # <provider dir> <kustomize base> <components file> <image>
  local dir="$out/components/$1/$CAPI_VERSION"
  mkdir -p "$dir"
  "$kubectl" kustomize "$src/$2" \
    | sed -e "s#image: .*controller:.*#image: $4#" > "$dir/$3"
  cp "$src/metadata.yaml" "$dir/metadata.yaml"
}
render cluster-api core/config/default core-components.yaml "registry.k8s.io/cluster-api/cluster-api-controller:$CAPI_VERSION"
render bootstrap-kubeadm bootstrap/kubeadm/config/default bootstrap-components.yaml "registry.k8s.io/cluster-api/kubeadm-bootstrap-controller:$CAPI_VERSION"
render control-plane-kubeadm controlplane/kubeadm/config/default control-plane-components.yaml "registry.k8s.io/cluster-api/kubeadm-control-plane-controller:$CAPI_VERSION"
# The unrendered CRDs, for tests that compare what clusterctl left in the apiserver.
mkdir -p "$out/crds"; cp "$src"/core/config/crd/bases/*.yaml "$out/crds/"
# cert-manager's CRDs at the version this clusterctl installs by default. Nothing here runs pods,
# so cert-manager itself never runs: the tests install its CRDs and tell clusterctl it is
# externally provisioned, and give the out-of-cluster webhooks self-signed certificates instead.
cm_version=$(sed -n 's/^\s*CertManagerDefaultVersion = "\(v[^"]*\)"/\1/p' "$src/cmd/clusterctl/client/config/cert_manager_client.go")
cm_dir=$(go mod download -json "github.com/cert-manager/cert-manager@$cm_version" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
[ -d "$cm_dir/deploy/crds" ] || { echo "capi/build.sh: no CRDs in cert-manager@$cm_version" >&2; exit 1; }
mkdir -p "$out/cert-manager-crds"; cp "$cm_dir"/deploy/crds/*.yaml "$out/cert-manager-crds/"
echo "$cm_version" > "$out/cert-manager-crds/VERSION"
touch "$stamp"
echo "capi: built Cluster API $CAPI_VERSION in $(( $(date +%s) - start ))s"
