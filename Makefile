# kvtier — two commands matter: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
# GPU users: make setup TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed

.PHONY: setup test demo bench proto proto-check lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e '.[dev,triton]'
	@touch $(STAMP)

proto: setup
	$(BIN)/python scripts/gen_proto.py

proto-check: setup
	$(BIN)/python scripts/gen_proto.py --check

lint: setup
	$(BIN)/ruff check kvtier worker controller tests loadtests scripts

test: setup lint proto-check
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: setup
	$(BIN)/kvtier demo --plot out/demo.png $(DEMO_ARGS)

bench: setup
	$(BIN)/python -m loadtests.bench_engine

clean:
	rm -rf $(VENV) build *.egg-info
