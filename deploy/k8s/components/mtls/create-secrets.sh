#!/usr/bin/env bash
# The Secrets the mtls component mounts, from a directory of `make certs`' files
# (ca.crt, <service>.crt, <service>.key) and an API keys file (JSON: key -> tenant), the
# production overlay's Milvus ones (milvus.crt and .key; a root password made here) and its
# tracing pipeline's (otel-loadbalancer, otel-tail-sampling and jaeger-collector .crt/.key):
#
#   deploy/k8s/components/mtls/create-secrets.sh .hopline/tls api-keys.json [namespace]
#
# For a real cluster, issue the certificates from your own CA (cert-manager: one Certificate
# per service, secretName hopline-tls-<service>, the service's name among its dnsNames,
# usages server auth and client auth; the same for each tracing tier in the observability
# namespace, secretName otel-tls-<tier>); `make certs`' CA is for trying it out.
set -euo pipefail
certs=$1
keys=$2
namespace=${3:-hopline}
for service in gateway tokenizer cache inference postprocess; do
  kubectl -n "$namespace" create secret generic "hopline-tls-$service" \
    --from-file=tls.crt="$certs/$service.crt" --from-file=tls.key="$certs/$service.key" \
    --from-file=ca.crt="$certs/ca.crt" --dry-run=client -o yaml | kubectl apply -f -
done
kubectl -n "$namespace" create secret generic hopline-api-keys \
  --from-file=keys.json="$keys" --dry-run=client -o yaml | kubectl apply -f -
# The production overlay's Milvus: its server certificate (one naming `milvus`: make certs
# writes milvus.crt), and the root password it takes at its first start with the cache's token
# beside it, made once: Milvus keeps the first password, so a second run must not change it.
kubectl -n "$namespace" create secret generic hopline-tls-milvus \
  --from-file=tls.crt="$certs/milvus.crt" --from-file=tls.key="$certs/milvus.key" \
  --from-file=ca.crt="$certs/ca.crt" --dry-run=client -o yaml | kubectl apply -f -
# The tracing pipeline's tiers (deploy/observability, in its own namespace): each tier's
# certificate (`make certs --deploy` names them: the first tier's carries the Service's
# cluster DNS name the services dial) and the CA that every OTLP link checks both sides with.
kubectl create namespace observability --dry-run=client -o yaml | kubectl apply -f - >/dev/null
for tier in loadbalancer:otel-loadbalancer tail-sampling:otel-tail-sampling jaeger:jaeger-collector; do
  kubectl -n observability create secret generic "otel-tls-${tier%%:*}" \
    --from-file=tls.crt="$certs/${tier#*:}.crt" --from-file=tls.key="$certs/${tier#*:}.key" \
    --from-file=ca.crt="$certs/ca.crt" --dry-run=client -o yaml | kubectl apply -f -
done
if ! kubectl -n "$namespace" get secret hopline-milvus-token >/dev/null 2>&1; then
  password=$(openssl rand -hex 24)
  kubectl -n "$namespace" create secret generic hopline-milvus-token \
    --from-literal=password="$password" --from-literal=token="root:$password" >/dev/null
fi
# The cache's own Milvus user's token (`hopline cache milvus-user`, the overlay's Job, makes
# the user with it), made once too: Milvus keeps the password it was first given.
if ! kubectl -n "$namespace" get secret hopline-milvus-cache-token >/dev/null 2>&1; then
  kubectl -n "$namespace" create secret generic hopline-milvus-cache-token \
    --from-literal=token="hopline_cache:$(openssl rand -hex 24)" >/dev/null
fi
