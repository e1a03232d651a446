# Two entry points: `make run` (set up, then run the pipeline) and `make test` (set up, then test).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup run test lint format clean bench system-deps

setup: $(VENV)/.installed

# Install the project and its pinned, known-good dependency set (constraints.txt) into a venv.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,postgres]'
	touch $@

run: setup
	$(PY) flows/pipeline.py $(ARGS)

# PostgreSQL for tests/test_postgres_stack.py: apt-installed when missing, a ~5 ms no-op when present.
system-deps:
	bash scripts/postgres.sh install || echo "PostgreSQL could not be installed; tests/test_postgres_stack.py will be skipped" >&2

# Ruff (configured in pyproject.toml): lint rules and the formatter's check; `make format` applies both fixes.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: setup system-deps lint
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) workdir .pytest_cache
