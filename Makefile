# The two commands of a fresh machine:
#   make demo   llmgw on its embedded default (SQLite, file broker) under ./var/demo,
#               with a simulated cluster (`make up`: the control plane alone, under ./var)
#   make test   the test suite, against PostgreSQL and Redis on 127.0.0.1
# Each creates the virtual environment it needs in .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# The project is installed editable, and an editable install learns its
# top-level packages when it is made: a new package means installing again.
PACKAGES := $(wildcard */__init__.py)
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
# What the targets in mk/*.mk depend on: everything installed.
STAMP := $(DEV_STAMP)

# What `make test` runs, and what README.md and docs/development.md show
# (tests/test_docs.py checks that they agree). The suite runs in TEST_WORKERS
# pytest-xdist workers; worker N creates and drops test_<database>_gwN and
# empties Redis database <that of TEST_REDIS_URL> - N (tests/parallel.py).
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/llmgw
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
TEST_WORKERS ?= 4
TEST_ENV := DATABASE_URL=$(TEST_DATABASE_URL) \
	CELERY_BROKER_URL=$(TEST_REDIS_URL) \
	LLMGW_REDIS_URL=$(TEST_REDIS_URL) \
	LLMGW_DATA_DIR=$(CURDIR)/var/test
TEST_CMD := $(TEST_ENV) $(PY) -m pytest -n $(TEST_WORKERS)

.PHONY: up demo test venv venv-dev test-deps services prod-check bench-heartbeats agent-wheel bench-onboard clean
# A bare `make` only prepares .venv (the files in mk/ define targets first).
.DEFAULT_GOAL := venv

# Targets of later capabilities live beside this file, one file each.
-include mk/*.mk

$(RUN_STAMP): requirements.txt pyproject.toml $(PACKAGES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements.txt
	$(PIP) install --quiet --no-deps -e .
	touch $@

$(DEV_STAMP): $(RUN_STAMP) requirements-dev.txt
	$(PIP) install --quiet -r requirements-dev.txt
	touch $@

venv: $(RUN_STAMP)

venv-dev: $(DEV_STAMP)

# The first thing to run on a fresh machine: llmgw on its embedded default with
# a simulated cluster of four nodes in two fabrics and a sample catalog.
demo: $(RUN_STAMP)
	$(VENV)/bin/llmgw demo $(DEMO_ARGS)

# `make up UP_ARGS="--web-port 8080 --host 0.0.0.0"` passes options to `llmgw up`.
up: $(RUN_STAMP)
	$(VENV)/bin/llmgw up $(UP_ARGS)

# Debian's Chromium for the browser tests, and PostgreSQL and Redis running.
test-deps:
	bash scripts/test-deps.sh

services:
	bash scripts/services.sh

# `make test PYTEST_ARGS="-k outage -x"` narrows the run; TEST_WORKERS=0 runs it in one process.
test: $(DEV_STAMP) test-deps services
	$(TEST_CMD) $(PYTEST_ARGS)

# The production process set (web, agent API, worker, beat) from a venv made
# of requirements.txt alone, on PostgreSQL and Redis: a node registers and a
# replica becomes ready. CI runs it after the tests.
prod-check: services
	$(PYTHON) scripts/prod_check.py

# `make bench-heartbeats BENCH_HEARTBEATS_ARGS="--nodes 5000"`
bench-heartbeats: $(DEV_STAMP) services
	$(TEST_ENV) $(PY) bench/heartbeats.py $(BENCH_HEARTBEATS_ARGS)

# The node agent as its own distribution (llmgw-agent) and the wheels it
# depends on, for nodes without internet: var/agent-wheels/<digest>/, built
# once per version of agent/ (the onboarding job builds the same on demand).
agent-wheel: $(RUN_STAMP)
	$(PY) -m provisioning.agentwheel var/agent-wheels

# `make bench-onboard BENCH_ONBOARD_ARGS="--nodes 20"`: onboarding over real sshd.
bench-onboard: $(DEV_STAMP) services
	$(PY) bench/onboard.py $(BENCH_ONBOARD_ARGS)

clean:
	rm -rf $(VENV) var
