#!/usr/bin/env bash
# Starts etcd + kube-apiserver on free loopback ports (data, logs and kubeconfig in
# target/control-plane/run unless --dir is given) and leaves them running; stop.sh ends them.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
"$root/hack/control-plane/build.sh"
cd "$root" && exec cargo run --quiet -- control-plane start "$@"
