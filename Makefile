# Two entry points: `make run` (set up, then run the pipeline) and `make test` (set up, then test).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=
# Tests run on this many processes; the tests sharing a module's fixture (a server, a run) on one, the slowest
# first, in the order tests/conftest.py gives (xdist's reordering off).
TEST_WORKERS ?= 2

# Servers for the UI path (README "Run on a Prefect server"): all on 127.0.0.1, any free port.
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000
SERVE_PORT ?= 5001
WORKDIR ?= $(CURDIR)/workdir
PREFECT_API_URL ?= http://127.0.0.1:$(PREFECT_PORT)/api
MLFLOW_TRACKING_URI ?= sqlite:///$(WORKDIR)/mlflow.db
SERVE_FLAGS ?=  # e.g. --alias challenger --max-batch 32 (flows/serve.py --help)
# Framework start-up lines and offline telemetry stay out of the logs; CIFAR_VERBOSE=1 lets them through.
QUIET := $(if $(filter 1,$(CIFAR_VERBOSE)),,TF_CPP_MIN_LOG_LEVEL=2 MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false)

.PHONY: setup run test test-quick fuzz lint format clean bench server deploy worker mlflow-ui serve search ui-check stack-check \
	stack-env stack-ca backup restore

setup: $(VENV)/.installed

# Install the project and its pinned, known-good dependency set (constraints.txt) into a venv. uv (pinned there
# too) installs the same pins as pip, from its cache in less than half pip's time (CI starts with this; on AMD
# EPYC family 26: 32 s against 79 s, bench/setup_install.py), and compiles the bytecode every process needs
# where PYTHONDONTWRITEBYTECODE keeps Python from saving it. pip does it all when uv cannot (say, a package
# only in a wheelhouse that pip.conf names).
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt uv && $(VENV)/bin/uv pip install --quiet --python $(PY) --native-tls \
		--compile-bytecode -c constraints.txt -e '.[dev,postgres]' || { echo "setup: uv failed, pip installs instead"; \
		$(PY) -m pip install --quiet --upgrade pip && $(PY) -m pip install --quiet -c constraints.txt -e '.[dev,postgres]'; }
	touch $@

# What `make run` trains: the `fast` preset, more accurate in less time on a CPU than the `default`
# preset (ResNet-20) that `python flows/pipeline.py` keeps: 91.97 % in ~22 minutes against 83.33 % in 29
# on 2 AMD EPYC cores (README "Presets"). PRESET=default for ResNet-20; a --preset in ARGS wins.
PRESET ?= fast
run: setup
	$(PY) flows/pipeline.py $(if $(PRESET),--preset $(PRESET)) $(ARGS)

# Ruff (configured in pyproject.toml): lint rules and the formatter's check; `make format` applies both fixes.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: setup lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

# Before each commit: the unit tests and the fast integration tests, without those marked `slow` or
# `integration` (pipelines in processes, servers, real trainings); about a minute on 2 cores (README, "Tests").
test-quick: setup lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not slow and not integration" \
		$(PYTEST_ARGS)

# The fuzz suite (tests/test_fuzz_*.py) beyond make test's few seeded examples: each door for its share of
# FUZZ_MINUTES, new seeds every round; failing examples are kept in .hypothesis/examples/ (scripts/fuzz.py).
FUZZ_MINUTES ?= 10
fuzz: setup
	$(PY) -m scripts.fuzz --minutes $(FUZZ_MINUTES)

bench: setup
	$(PY) bench/run_all.py

# The Prefect server and its UI on PREFECT_PORT (the UI must be told its own API's address; logs are
# streamed so that `prefect deployment run --watch` shows each run's log lines, the summary included).
server: setup
	$(QUIET) PYTHON=$(PY) PREFECT_UI_API_URL=$(PREFECT_API_URL) PREFECT_API_URL=$(PREFECT_API_URL) \
	  PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED=true PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED=true \
	  scripts/prefect_server.sh --host 127.0.0.1 --port $(PREFECT_PORT)

# Once per server: the work pool, one training per device at a time, every deployment in prefect.yaml, and
# the notifications (CIFAR_NOTIFY_WEBHOOK_URL; README "Continuous training"). Safe to run again.
deploy: setup
	PREFECT_API_URL=$(PREFECT_API_URL) $(VENV)/bin/prefect work-pool inspect cifar-process >/dev/null 2>&1 || \
	  PREFECT_API_URL=$(PREFECT_API_URL) $(VENV)/bin/prefect work-pool create cifar-process --type process
	PREFECT_API_URL=$(PREFECT_API_URL) $(VENV)/bin/prefect concurrency-limit inspect training >/dev/null 2>&1 || \
	  PREFECT_API_URL=$(PREFECT_API_URL) $(VENV)/bin/prefect concurrency-limit create training 1
	PREFECT_API_URL=$(PREFECT_API_URL) $(VENV)/bin/prefect --no-prompt deploy --all
	PREFECT_API_URL=$(PREFECT_API_URL) $(PY) flows/automations.py

# A process worker; flow runs start in this checkout (the deployments' pull step reads PWD).
worker: setup
	$(QUIET) PWD=$(CURDIR) PATH=$(CURDIR)/$(VENV)/bin:$$PATH PREFECT_API_URL=$(PREFECT_API_URL) \
	  MLFLOW_TRACKING_URI=$(MLFLOW_TRACKING_URI) $(VENV)/bin/prefect worker start --pool cifar-process

# The MLflow UI over a store (default: the local pipeline's SQLite store under WORKDIR), without MLflow's
# job runner (GenAI jobs; docker/compose.yaml says why).
mlflow-ui: setup
	$(QUIET) MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui --backend-store-uri $(MLFLOW_TRACKING_URI) --host 127.0.0.1 --port $(MLFLOW_PORT)

# The endpoint on SERVE_PORT (127.0.0.1): the registry's champion, followed without a restart; photos or JSON in
# (README "Serving"; flags: .venv/bin/python flows/serve.py --help).
serve: setup
	$(QUIET) $(PY) flows/serve.py --tracking-uri $(MLFLOW_TRACKING_URI) --host 127.0.0.1 --port $(SERVE_PORT) $(SERVE_FLAGS)

# A hyperparameter search (flows/search.py): TRIALS trials, PARALLEL at a time on local workers.
TRIALS ?= 8
PARALLEL ?= 2
search: setup
	$(PY) flows/search.py --preset smoke --trials $(TRIALS) --parallel $(PARALLEL) --workdir $(WORKDIR) $(ARGS)

# Both UIs in headless Chromium after a smoke run and a sweep on the shared archive; screenshots into
# docs/images/ (OUT=DIR elsewhere); exits 1 when a person would not see what they must. ~3-5 minutes.
OUT ?= docs/images
ui-check: setup
	PLAYWRIGHT_SPEC=playwright==1.65.2 bash scripts/install_browser.sh
	$(PY) -m scripts.ui_check --out $(OUT) $(ARGS)

# docker/compose.yaml end to end (scripts/stack_check/): builds the images, brings the stack up as a
# throwaway compose project, checks it through the containers and the servers' APIs, then removes it.
# Installs Podman when missing; ENGINE=docker uses Docker; GPU=1 also builds the CUDA image.
stack-check: setup
	$(PY) -m scripts.stack_check

# The compose stack's state (scripts/backup/): both databases (pg_dump), the MLflow artifacts and the workdir
# volume, to BACKUP_DIR/<UTC time>/ with a manifest of sizes and SHA-256s; `make restore BACKUP=DIR` verifies
# it and restores it into an empty stack (FORCE=1 deletes the project's containers and volumes first).
# ENGINE=docker for Docker; COMPOSE_PROJECT and ENV_FILE name another stack.
BACKUP_DIR ?= backups
COMPOSE_PROJECT ?= cifar
ENV_FILE ?= docker/.env
BACKUP_OPTIONS = --project $(COMPOSE_PROJECT) --env-file $(ENV_FILE) $(if $(ENGINE),--engine $(ENGINE))
backup: setup
	$(PY) -m scripts.backup $(BACKUP_OPTIONS) backup --out $(BACKUP_DIR)

restore: setup
	@test -n "$(BACKUP)" || { echo "error: name the backup: make restore BACKUP=backups/<UTC time>" >&2; exit 2; }
	$(PY) -m scripts.backup $(BACKUP_OPTIONS) restore $(BACKUP) $(if $(filter 1,$(FORCE)),--force)

# docker/.env for docker/compose.yaml: docker/env.example's settings, every missing password generated and
# printed once (docs/PRODUCTION.md "Sign-in"). Run again after an upgrade adds a secret: it fills in only those.
stack-env:
	$(PYTHON) -m scripts.stack_env

# The running stack's CA certificate (its front door's local CA) into docker/ca.crt, for clients and the
# workers of other machines (docker/worker-remote.yaml). COMPOSE=podman-compose with Podman.
COMPOSE ?= docker compose
stack-ca:
	$(COMPOSE) -f docker/compose.yaml exec -T proxy cat /certs/ca.crt > docker/ca.crt
	@echo "docker/ca.crt: the front door's CA; clients trust it (SSL_CERT_FILE, REQUESTS_CA_BUNDLE, curl --cacert)"

clean:
	rm -rf $(VENV) workdir .pytest_cache
