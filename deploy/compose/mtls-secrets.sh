#!/usr/bin/env bash
# The files compose.mtls.yaml mounts, from a directory of `make certs`' files (ca.crt,
# <service>.crt, <service>.key) and an API keys file (JSON: key -> tenant):
#
#   deploy/compose/mtls-secrets.sh .hopline/tls api-keys.json [OUT]
#
# OUT (default deploy/compose/secrets) gets a folder per service holding only that
# service's tls.crt, tls.key and ca.crt, api-keys/keys.json, jaeger/ (Jaeger's OTLP
# receiver's certificate), milvus/ (the Milvus server's certificate), milvus-root/token (root's token, for the one-shot milvus-cache-user alone) and
# milvus-token/token (the cache's own user's token): root-owned, group 10001
# (the image's user), mode 0440, so each container reads its own key and nothing else does,
# as a Kubernetes Secret mounted with defaultMode 0440 under fsGroup 10001. Run as root (the
# group change needs it), or for rootless podman under `podman unshare` (root in your user
# namespace: group 10001 there is the subordinate group your containers see as 10001). For anything beyond trying it out, issue the certificates from
# your own CA; each must name its service (DNS name or common name).
set -euo pipefail
certs=$1
keys=$2
out=${3:-"$(dirname "$0")/secrets"}
group=10001
if [ "$(id -u)" -ne 0 ]; then
  echo "run as root, or under \`podman unshare\` for rootless podman: the files must belong to group $group (the image's user)" >&2
  exit 1
fi
[ -r "$certs/ca.crt" ] || { echo "cannot read $certs/ca.crt (make certs writes a CA and certificates)" >&2; exit 1; }
[ -r "$keys" ] || { echo "cannot read $keys (the API keys: JSON, key -> tenant)" >&2; exit 1; }
for server in milvus jaeger-collector; do
  for part in crt key; do
    [ -r "$certs/$server.$part" ] || { echo "cannot read $certs/$server.$part (make certs writes the $server server's certificate)" >&2; exit 1; }
  done
done

place() {  # place FOLDER NAME=SOURCE...
  local folder=$1
  shift
  install -d -m 0750 -o 0 -g "$group" "$folder"
  for pair in "$@"; do
    install -m 0440 -o 0 -g "$group" "${pair#*=}" "$folder/${pair%%=*}"
  done
}

for service in gateway tokenizer cache inference postprocess; do
  for part in crt key; do
    [ -r "$certs/$service.$part" ] || { echo "cannot read $certs/$service.$part" >&2; exit 1; }
  done
  place "$out/$service" tls.crt="$certs/$service.crt" tls.key="$certs/$service.key" \
    ca.crt="$certs/ca.crt"
done
place "$out/api-keys" keys.json="$keys"
# Jaeger's OTLP receiver: make certs' jaeger-collector certificate, which also names `jaeger`.
place "$out/jaeger" tls.crt="$certs/jaeger-collector.crt" tls.key="$certs/jaeger-collector.key" \
  ca.crt="$certs/ca.crt"
# Milvus (compose.mtls.yaml: authentication and mutual TLS): its server certificate, its root
# password and the cache's own user's, each made once (Milvus takes the root one at its first
# start and keeps it, `hopline cache milvus-user` keeps an existing user's; root-only here):
# the root password for Milvus in milvus-config/user.yaml, its configuration file for
# settings over the image's, and as milvus-root/token for milvus-cache-user, which makes the
# cache's user from milvus-token/token.
place "$out/milvus" tls.crt="$certs/milvus.crt" tls.key="$certs/milvus.key" ca.crt="$certs/ca.crt"
for secret in milvus-root-password milvus-cache-password; do
  if [ ! -s "$out/$secret" ]; then
    (umask 077 && openssl rand -hex 24 > "$out/$secret")
  fi
done
password=$(cat "$out/milvus-root-password")
made=$(mktemp -d)
printf 'common:\n  security:\n    defaultRootPassword: "%s"\n' "$password" > "$made/user.yaml"
printf 'root:%s\n' "$password" > "$made/root-token"
printf 'hopline_cache:%s\n' "$(cat "$out/milvus-cache-password")" > "$made/token"
place "$out/milvus-config" user.yaml="$made/user.yaml"
place "$out/milvus-root" token="$made/root-token"
place "$out/milvus-token" token="$made/token"
rm -rf "$made"
echo "secrets in $out"
