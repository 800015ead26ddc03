# The two commands of a fresh machine:
#   make up     llmgw on its embedded default (SQLite, file broker) under ./var
#   make test   the test suite, against PostgreSQL and Redis on 127.0.0.1
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

TEST_ENV := DATABASE_URL=postgres://postgres@127.0.0.1:5432/llmgw \
	CELERY_BROKER_URL=redis://127.0.0.1:6379/15 \
	LLMGW_REDIS_URL=redis://127.0.0.1:6379/15 \
	LLMGW_DATA_DIR=$(CURDIR)/var/test

.PHONY: up test venv demo bench-heartbeats clean

# Targets of later capabilities live beside this file, one file each.
-include mk/*.mk

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/llmgw up

test: $(STAMP)
	scripts/test-deps.sh
	scripts/services.sh
	$(TEST_ENV) $(PY) -m pytest $(PYTEST_ARGS)

bench-heartbeats: $(STAMP)
	scripts/services.sh
	$(TEST_ENV) $(PY) bench/heartbeats.py

clean:
	rm -rf $(VENV) var

# The first thing to run on a fresh machine: llmgw with a simulated cluster.
demo: $(STAMP)
	$(VENV)/bin/llmgw demo
