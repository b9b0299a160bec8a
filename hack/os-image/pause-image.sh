#!/usr/bin/env bash
# Builds the Kubernetes pause image (the pod sandbox's first process) from the pinned Kubernetes
# release's own source (build/pause/linux/pause.c in the k8s.io/kubernetes module), as its
# Makefile does (static, -Os), and packs it as an image archive `ctr images import` takes, tagged
# registry.k8s.io/pause:<PauseVersion of that release>. No registry is reachable from the lab.
# Usage: pause-image.sh <out.tar>
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../control-plane/versions.env
source "$here/../control-plane/versions.env"
out=${1:?usage: pause-image.sh <out.tar>}
command -v gcc >/dev/null || { echo "pause image: gcc is required (make deps)" >&2; exit 1; }
src=$(cd "$here/../control-plane" && go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
[ -f "$src/build/pause/linux/pause.c" ] || { echo "pause image: no build/pause/linux/pause.c in k8s.io/kubernetes@$KUBERNETES_VERSION" >&2; exit 1; }
tag=$(sed -n 's/^[[:space:]]*PauseVersion = "\(.*\)"/\1/p' "$src/cmd/kubeadm/app/constants/constants.go")
[ -n "$tag" ] || { echo "pause image: no PauseVersion in kubeadm's constants" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/rootfs"
gcc -Os -Wall -Werror -static -DVERSION="v$tag-metalboot" -o "$work/rootfs/pause" "$src/build/pause/linux/pause.c"
strip "$work/rootfs/pause"
# One layer holding /pause, with fixed owners and times so the same source gives the same digest.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$work/rootfs" -cf "$work/layer.tar" pause
layer=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
mkdir -p "$work/image/$layer"
mv "$work/layer.tar" "$work/image/$layer/layer.tar"
printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/pause"],"User":"65535:65535"},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' "$layer" > "$work/config.json"
config=$(sha256sum "$work/config.json" | cut -d' ' -f1)
mv "$work/config.json" "$work/image/$config.json"
printf '[{"Config":"%s.json","RepoTags":["registry.k8s.io/pause:%s"],"Layers":["%s/layer.tar"]}]' "$config" "$tag" "$layer" > "$work/image/manifest.json"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$work/image" -cf "$out" manifest.json "$config.json" "$layer/layer.tar"
echo "pause image: registry.k8s.io/pause:$tag from k8s.io/kubernetes@$KUBERNETES_VERSION ($(stat -c %s "$work/image/$layer/layer.tar") byte layer)"
