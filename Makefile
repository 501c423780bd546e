# pergola — `make serve` and `make test` each set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-gpu build-repo bundle clean

setup: $(VENV)/.pergola-installed

# One venv holds the server's Python side too: the Triton stub runs this venv's python3,
# which keeps numpy < 2 (pinned in pyproject.toml) as the stub requires.
$(VENV)/.pergola-installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	touch $@

serve: setup
	$(BIN)/pergola serve $(ARGS)

build-repo: setup
	$(BIN)/pergola build-repo $(ARGS)

test: setup
	$(BIN)/python -m pytest -q -ra tests $(PYTEST_ARGS)

bundle: setup
	$(BIN)/python scripts/gpu_bundle.py $(ARGS)

clean:
	rm -rf model_repository .pytest_cache
