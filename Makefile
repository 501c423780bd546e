# pergola — `make serve` and `make test` each set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-container test-gpu build-repo bundle docs clean

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

# The CPU image, built with podman and run as the README and deploy/docker-compose.yml say
# (docs/container.md): podman, runc, mmdebstrap from Debian if missing and a containers.conf for
# this host, a Debian base from Debian's archive (once), the image (its layers cached), then
# tests/test_container.py, which fails here where it would skip in `make test`. Needs root.
CONTAINER_BASE ?= localhost/debian-python:bookworm

test-container: setup
	bash scripts/container_base.sh $(CONTAINER_BASE)
	PYTHON=$(BIN)/python bash scripts/build_image.sh --cpu --base $(CONTAINER_BASE)
	PERGOLA_CONTAINER_REQUIRED=1 $(BIN)/python -m pytest -q -ra tests/test_container.py $(PYTEST_ARGS)

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or anchor is an error.
docs: setup
	$(BIN)/mkdocs build --strict

bundle: setup
	$(BIN)/python scripts/gpu_bundle.py $(ARGS)

clean:
	rm -rf model_repository .pytest_cache site
