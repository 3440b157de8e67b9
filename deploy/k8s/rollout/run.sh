#!/usr/bin/env bash
# Applies a kustomize overlay to a real control plane on loopback and waits for every
# Deployment and StatefulSet to roll out, then rolls every Deployment again (a restart: every
# pod replaced under its PodDisruptionBudget and maxUnavailable 0) and waits once more.
#
# The control plane is real (etcd, kube-apiserver, kube-controller-manager, kube-scheduler);
# the nodes are kwok's: fake kubelets that mark pods Running and Ready without running a
# container, so this proves the objects are accepted, scheduled within their requests and
# rolled out, not that the image serves (make image-smoke does that).
#
# Usage: run.sh BINDIR OVERLAY   (BINDIR holds kube-apiserver, kube-controller-manager,
# kube-scheduler and kwok; etcd and kubectl come from PATH)
set -euo pipefail
bin=$(cd "$1" && pwd)
overlay=$2
work=$(mktemp -d)
pids=()
cleanup() {
  # SIGKILL: a throwaway control plane; kube-apiserver's graceful shutdown takes a minute.
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
etcd_port=$(free_port); peer_port=$(free_port); api_port=$(free_port)
log() { echo "[$(date +%T)] $*"; }

openssl genrsa -out "$work/sa.key" 2048 2>/dev/null
echo "rollout-token,admin,admin,system:masters" > "$work/tokens.csv"
cat > "$work/kubeconfig" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
  - name: local
    cluster:
      server: https://127.0.0.1:$api_port
      insecure-skip-tls-verify: true
users:
  - name: admin
    user:
      token: rollout-token
contexts:
  - name: local
    context: {cluster: local, user: admin}
current-context: local
KUBECONFIG
export KUBECONFIG=$work/kubeconfig

log "etcd on 127.0.0.1:$etcd_port"
etcd --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
  --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "default=http://127.0.0.1:$peer_port" > "$work/etcd.log" 2>&1 &
pids+=($!)

log "kube-apiserver on 127.0.0.1:$api_port"
"$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$etcd_port" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
  --cert-dir "$work/certs" --token-auth-file "$work/tokens.csv" \
  --authorization-mode RBAC \
  --service-account-issuer https://kubernetes.default.svc \
  --service-account-key-file "$work/sa.key" \
  --service-account-signing-key-file "$work/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 \
  --endpoint-reconciler-type none > "$work/apiserver.log" 2>&1 &
# (no endpoint reconciler: it refuses a loopback address for the `kubernetes` Service)
apiserver=$!
pids+=($apiserver)
for _ in $(seq 300); do
  kubectl get --raw /readyz >/dev/null 2>&1 && break
  kill -0 "$apiserver" 2>/dev/null || break
  sleep 0.5
done
kubectl get --raw /readyz >/dev/null || { tail -20 "$work/apiserver.log"; exit 1; }

# kwok's heartbeats come late on a loaded machine; the node lifecycle controller would then
# mark every pod NotReady mid-rollout. Fake nodes' health is not what this checks.
"$bin/kube-controller-manager" --kubeconfig "$KUBECONFIG" --leader-elect=false \
  --node-monitor-grace-period 1h \
  --service-account-private-key-file "$work/sa.key" --root-ca-file "$work/certs/apiserver.crt" \
  --secure-port 0 > "$work/controller-manager.log" 2>&1 &
pids+=($!)
"$bin/kube-scheduler" --kubeconfig "$KUBECONFIG" --leader-elect=false --secure-port 0 \
  > "$work/scheduler.log" 2>&1 &
pids+=($!)
"$bin/kwok" --kubeconfig "$KUBECONFIG" --manage-all-nodes=false \
  --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
  --cidr 10.244.0.1/16 --node-ip 10.0.0.1 > "$work/kwok.log" 2>&1 &
pids+=($!)

log "three fake nodes, and volumes for the overlay's claims"
for n in 1 2 3; do
  kubectl apply -f - >/dev/null <<NODE
apiVersion: v1
kind: Node
metadata:
  name: kwok-node-$n
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    kubernetes.io/hostname: kwok-node-$n
    topology.kubernetes.io/zone: zone-$n
status:
  allocatable: {cpu: "16", memory: 64Gi, pods: "110"}
  capacity: {cpu: "16", memory: 64Gi, pods: "110"}
NODE
done
for pv in models:ReadWriteMany:2Gi milvus:ReadWriteOnce:20Gi; do
  IFS=: read -r name mode size <<< "$pv"
  kubectl apply -f - >/dev/null <<PV
apiVersion: v1
kind: PersistentVolume
metadata:
  name: rollout-$name
spec:
  accessModes: [$mode]
  capacity: {storage: $size}
  hostPath: {path: /tmp/rollout-$name}
PV
done

log "kubectl apply -k $overlay"
kubectl kustomize "$overlay" > "$work/objects.yaml"
# The Secrets the overlay's pods mount (the mtls component's certificates and API keys) are
# the operator's to create before the apply, as its README says: made here from a throwaway
# CA (`make certs`' code) with the component's own script.
if grep -q 'secretName: hopline-' "$work/objects.yaml"; then
  log "the mtls component's Secrets, from a throwaway CA"
  "${PY:-python3}" -m hopline.cli.certs "$work/tls" --deploy >/dev/null
  echo '{"rollout-key": "rollout"}' > "$work/api-keys.json"
  kubectl create namespace hopline >/dev/null
  "$(dirname "$0")/../components/mtls/create-secrets.sh" "$work/tls" "$work/api-keys.json" >/dev/null
fi
# kustomize orders Namespaces first, so one apply creates everything.
kubectl apply -f "$work/objects.yaml"
# kwok's nodes run no containers, so a pod whose Secret is missing would still come up here;
# a real kubelet would leave it ContainerCreating. Check every Secret a workload mounts exists.
for ref in $(kubectl get deploy,statefulset,job -A -o jsonpath='{range .items[*]}{.metadata.namespace}/{range .spec.template.spec.volumes[*]}{.secret.secretName},{end}{"\n"}{end}' | sort -u); do
  ns=${ref%%/*}
  for secret in $(tr ',' ' ' <<< "${ref#*/}"); do
    kubectl -n "$ns" get secret "$secret" >/dev/null 2>&1 ||
      { echo "a workload in $ns mounts Secret $secret, which does not exist"; exit 1; }
  done
done
workloads=$(kubectl get deploy,statefulset -A -o jsonpath='{range .items[*]}{.metadata.namespace}/{.kind}/{.metadata.name}{"\n"}{end}')
[ -n "$workloads" ] || { echo "no Deployment or StatefulSet was created"; exit 1; }
count=0
for w in $workloads; do
  IFS=/ read -r ns kind name <<< "$w"
  kubectl -n "$ns" rollout status "$kind/$name" --timeout=300s
  count=$((count + 1))
done
log "$count workloads rolled out"

# Every Deployment restarts at once; each replaces its own pods one at a time (maxSurge 1,
# maxUnavailable 0, its PodDisruptionBudget). One Deployment after another took 10 of the
# stage's 12 minutes: an old pod stays Terminating for its grace period (35 s) on kwok's nodes,
# so each Deployment waited about 75 s.
log "rolling restart of every Deployment, each pod by pod"
restarted=0
for w in $workloads; do
  IFS=/ read -r ns kind name <<< "$w"
  [ "$kind" = Deployment ] || continue
  kubectl -n "$ns" rollout restart "deployment/$name" >/dev/null
  restarted=$((restarted + 1))
done
for w in $workloads; do
  IFS=/ read -r ns kind name <<< "$w"
  [ "$kind" = Deployment ] || continue
  kubectl -n "$ns" rollout status "deployment/$name" --timeout=300s
done
kubectl get pods -A -o wide
log "done: $count workloads rolled out, then $restarted Deployments replaced pod by pod"
