# Quickstart: `make demo` runs the embedded default end to end; `make test` runs the tests.
# Both create .venv if missing and install the package with the CPU extra; both are safe to re-run.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.async-grpo-installed
# Two workers (pytest-xdist), one test module each at a time (`loadscope`: a module's fixtures, such as its vLLM
# server, start once), each worker on its own share of the cores, the longest modules handed out first
# (`--no-loadscope-reorder` keeps tests/conftest.py's order; the reasons and the measurements are there and in
# docs/development.md). `make test PYTEST_ARGS=` runs the suite serially on every core.
PYTEST_ARGS ?= --durations=25 --numprocesses=2 --dist=loadscope --no-loadscope-reorder

.PHONY: install demo test test-fast lint clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

# The KFP pipeline (prepare_dataset -> train_grpo -> evaluate -> register_model) on this machine through
# kfp.local, with the local launch backend: real vLLM server, reward workers, trainer and MLflow registry.
demo: install
	$(BIN)/async-grpo pipeline run-local --config examples/tiny_cpu.yaml

test: install lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The fast tier: every test without the `integration` marker (no vLLM server, no real run), on two workers.
test-fast: install lint
	$(BIN)/python -m pytest -m "not integration" --numprocesses=2 --dist=loadscope

# ruff's lint and format check, configured in pyproject.toml (`ruff format .` fixes the formatting)
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf runs mlruns .pytest_cache
