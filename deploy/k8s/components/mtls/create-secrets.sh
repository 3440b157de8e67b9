#!/usr/bin/env bash
# The Secrets the mtls component mounts, from a directory of `make certs`' files
# (ca.crt, <service>.crt, <service>.key) and an API keys file (JSON: key -> tenant):
#
#   deploy/k8s/components/mtls/create-secrets.sh .hopline/tls api-keys.json [namespace]
#
# For a real cluster, issue the certificates from your own CA (cert-manager: one Certificate
# per service, secretName hopline-tls-<service>, the service's name among its dnsNames,
# usages server auth and client auth); `make certs`' CA is for trying it out.
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
