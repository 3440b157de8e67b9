#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager and kube-scheduler (a control plane for
# `make k8s-rollout`; kwok plays the nodes) from the k8s.io/kubernetes module, offline after the
# Go module proxy: the module's go.mod points its k8s.io/* staging modules at ./staging,
# which the module zip leaves out (each is a module of its own), so the replaces are pointed
# at the published k8s.io/* modules of the same release (v0.X.Y for v1.X.Y).
# Usage: build-control-plane.sh VERSION OUTDIR   (VERSION like v1.33.5; GOPATH etc. from the caller)
set -euo pipefail
version=$1
out=$2
staging=v0${version#v1}
go mod download "k8s.io/kubernetes@$version"
src=$(go env GOMODCACHE)/k8s.io/kubernetes@$version
work=$(mktemp -d)
trap 'chmod -R u+w "$work"; rm -rf "$work"' EXIT
cp -r "$src/." "$work/"
chmod -R u+w "$work"
cd "$work"
rm -f go.work go.work.sum
for module in $(go mod edit -json | python3 -c '
import json, sys
for r in json.load(sys.stdin).get("Replace") or []:
    if r["New"]["Path"].startswith("./staging/"):
        print(r["Old"]["Path"])'); do
  go mod edit -dropreplace="$module" -require="$module@$staging"
done
mkdir -p "$out.tmp"
GOWORK=off GOFLAGS=-mod=mod go build -trimpath -o "$out.tmp/" \
  ./cmd/kube-apiserver ./cmd/kube-controller-manager ./cmd/kube-scheduler
mkdir -p "$out"
mv "$out.tmp"/* "$out/"
rmdir "$out.tmp"
