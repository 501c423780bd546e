# pergola — `make serve` and `make test` each set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
PYTEST_ARGS ?=
# A requirement installed before the project, e.g. TORCH=torch==2.13.0 where the host keeps that
# CPU build on disk (.ci/run): an unpinned `torch` resolves to a CUDA build of several GB.
TORCH ?=

.PHONY: setup serve lint test test-unit test-gpu soak test-container build-repo bundle docs clean

setup: $(VENV)/.pergola-installed

# One venv holds the server's Python side too: the Triton stub runs this venv's python3,
# which keeps numpy < 2 (pinned in pyproject.toml) as the stub requires.
$(VENV)/.pergola-installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	touch $@

serve: setup
	$(BIN)/pergola serve $(ARGS)

build-repo: setup
	$(BIN)/pergola build-repo $(ARGS)

# Test tiers (pyproject.toml's markers; docs/contributing.md): `make test` is the CI gate, ruff and
# unit + server tests (GPU tests skip without a GPU); the others are opt-in.
lint: setup
	$(BIN)/ruff check python_models client tests perf scripts

test: lint
	$(BIN)/python -m pytest -q -ra --durations=15 tests $(PYTEST_ARGS)

# No tritonserver: seconds to a few minutes, for the edit-test loop.
test-unit: setup
	$(BIN)/python -m pytest -q -ra -m "not server and not gpu and not soak and not container" tests $(PYTEST_ARGS)

# On a GPU host after scripts/gpu_setup.sh: the GPU-marked tests, then the server tests with the
# test server's encoders on the GPU (perf/gpu_session.sh gputests runs the same in slices).
test-gpu: setup
	PERGOLA_TEST_DEVICE=gpu $(BIN)/python -m pytest -q -ra -m gpu tests $(PYTEST_ARGS)
	PERGOLA_TEST_DEVICE=gpu $(BIN)/python -m pytest -q -ra -m "server and not gpu" tests $(PYTEST_ARGS)

# Memory stays flat under PERGOLA_SOAK_MINUTES (10) of varying traffic.
soak: setup
	$(BIN)/python -m pytest -q -ra -m soak tests $(PYTEST_ARGS)

# The site, as CI builds it (tests/test_docs.py does too).
docs: setup
	$(BIN)/mkdocs build --strict

# The CPU image, built with podman and run as the README and deploy/docker-compose.yml say
# (docs/container.md): podman, runc, mmdebstrap from Debian if missing and a containers.conf for
# this host, a Debian base from Debian's archive (once), the image (its layers cached), then
# tests/test_container.py, which fails here where it would skip in `make test`. Needs root.
CONTAINER_BASE ?= localhost/debian-python:bookworm

test-container: setup
	bash scripts/container_base.sh $(CONTAINER_BASE)
	PYTHON=$(BIN)/python bash scripts/build_image.sh --cpu --base $(CONTAINER_BASE)
	PERGOLA_CONTAINER_REQUIRED=1 $(BIN)/python -m pytest -q -ra -m container tests/test_container.py $(PYTEST_ARGS)

bundle: setup
	$(BIN)/python scripts/gpu_bundle.py $(ARGS)

clean:
	rm -rf model_repository .pytest_cache site
