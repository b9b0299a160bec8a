#!/bin/sh
# The lab's kubelet stand-in, run by the real cloud-init as a bootstrap command on the lab's
# Debian live system until a real kubelet joins (issue 16): registers this host's Node, named
# after its hostname, with the providerID from metalboot's meta-data and a Ready condition, so
# that upstream Cluster API core matches the Machine to it. A Node left by an earlier boot of the
# same host (a live host that rebooted) is the same node: AlreadyExists is success.
set -eu
. /etc/metalboot/kubelet.env
name=$(hostname)
provider_id=$(grep -o 'metalboot://[^" ]*' /run/cloud-init/instance-data.json | head -n1)
[ -n "$provider_id" ] || { echo "metalboot lab: no provider-id in the meta-data" >&2; exit 1; }
address=$(ip -o -4 addr show dev eth0 | awk '{split($4, a, "/"); print a[1]; exit}')
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
boot_id=$(cat /proc/sys/kernel/random/boot_id)
cat > /run/metalboot-node.json <<JSON
{"apiVersion":"v1","kind":"Node","metadata":{"name":"$name","labels":{"kubernetes.io/hostname":"$name","kubernetes.io/os":"linux","kubernetes.io/arch":"amd64"}},
 "spec":{"providerID":"$provider_id","taints":[{"key":"node.cluster.x-k8s.io/uninitialized","effect":"NoSchedule"}]},
 "status":{"conditions":[{"type":"Ready","status":"True","reason":"KubeletReady","message":"metalboot lab kubelet stand-in","lastHeartbeatTime":"$now","lastTransitionTime":"$now"}],
  "addresses":[{"type":"InternalIP","address":"$address"},{"type":"Hostname","address":"$name"}],
  "nodeInfo":{"machineID":"$boot_id","systemUUID":"$(cat /sys/class/dmi/id/product_uuid 2>/dev/null || true)","bootID":"$boot_id","kernelVersion":"$(uname -r)","osImage":"$(. /etc/os-release && echo "$PRETTY_NAME") (metalboot lab, live)","containerRuntimeVersion":"none://0","kubeletVersion":"${KUBELET_VERSION:-v1.36.3}","kubeProxyVersion":"","operatingSystem":"linux","architecture":"amd64"}}}
JSON
for try in 1 2 3 4 5 6 7 8 9 10; do
  code=$(curl -sS -o /run/metalboot-node.out -w '%{http_code}' -H "Authorization: Bearer $TOKEN" \
    -H "Content-Type: application/json" --data @/run/metalboot-node.json "$APISERVER/api/v1/nodes" || true)
  case "$code" in
    201|409) echo "metalboot lab: registered Node $name with providerID $provider_id ($code)" > /dev/console; exit 0 ;;
  esac
  echo "metalboot lab: Node registration answered ${code:-nothing}; retrying (try $try)" > /dev/console
  sleep 3
done
exit 1
