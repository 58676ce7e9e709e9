# Every target that runs code first makes sure the project's own virtual environment
# exists and matches pyproject.toml, so each one works as the first command on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements.lock
UV := uv==0.13.9

.PHONY: demo test lint bench proto venv lock clean static-manifests image image-offline

# Exact versions: every package, the dev tools and the installers included, is pinned in
# requirements.lock, and pip installs with it as constraints (build dependencies too), so a
# fresh machine gets the same environment as CI and the container image.
$(STAMP): pyproject.toml $(LOCK)
	@echo "make: installing kubegpu and its development tools into $(VENV) (first run only)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q -c $(LOCK) pip setuptools wheel
	@$(BIN)/python -m pip install -q -c $(LOCK) --build-constraint $(LOCK) -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

# Regenerate requirements.lock after a dependency changes in pyproject.toml: `make lock`.
# uv, pinned above and installed from PyPI into a throwaway environment under build/,
# resolves pyproject.toml with the dev extra, plus the installers (pip, setuptools, wheel),
# for Python 3.11 on every platform. Pins already in the lock stay unless pyproject.toml
# rules them out; `make lock UPGRADE=1` moves every pin to the newest allowed release.
lock:
	rm -rf build/lock-env
	$(PYTHON) -m venv build/lock-env
	build/lock-env/bin/python -m pip install -q $(UV)
	printf 'pip\nsetuptools\nwheel\n' | build/lock-env/bin/uv pip compile pyproject.toml - \
		--extra dev --python-version 3.11 --universal --custom-compile-command 'make lock' -q \
		$(if $(UPGRADE),--upgrade) -o $(LOCK)

# The demo needs only what the product runs on, not the development tools: a venv of its
# own with the runtime dependencies alone (the same pins), ready in a fraction of the time.
DEMO_VENV := build/demo-venv
DEMO_STAMP := $(DEMO_VENV)/.installed
$(DEMO_STAMP): pyproject.toml $(LOCK) $(shell find src -type f -not -path '*/__pycache__/*')
	@echo "make: installing kubegpu's runtime into $(DEMO_VENV) for the demo (first run only)"
	@test -x $(DEMO_VENV)/bin/python || $(PYTHON) -m venv $(DEMO_VENV)
	@$(DEMO_VENV)/bin/python -m pip install -q -c $(LOCK) pip setuptools wheel
	@rm -rf build/lib  # setuptools builds in the tree: a stale copy would ship deleted modules
	@$(DEMO_VENV)/bin/python -m pip install -q -c $(LOCK) --build-constraint $(LOCK) .
	@touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/kubegpu demo

# The whole suite with the coverage gate: at least 90 % of src/kubegpu, `kubegpu serve` and
# the NVML probe processes included (pyproject [tool.coverage]).
test: $(STAMP)
	$(BIN)/python -m pytest -q --cov=kubegpu --cov-report=term --cov-fail-under=90

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks deployments/render-static.py
	$(BIN)/ruff format --check src tests benchmarks deployments/render-static.py
	$(BIN)/mypy  # src/kubegpu, tests and benchmarks, all --strict (pyproject [tool.mypy])
	$(BIN)/mypy --strict deployments/render-static.py
	$(BIN)/lint-imports

# `make bench BENCH_ARGS=--quick`: every section with smaller counts; `--only dra api`: some.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I src --python_out=src --grpc_python_out=src --pyi_out=src src/kubegpu/api/api.proto src/kubegpu/api/pluginregistration.proto src/kubegpu/api/dra.proto src/kubegpu/api/dra_health.proto src/kubegpu/api/podresources.proto

static-manifests: $(STAMP)
	$(BIN)/python deployments/render-static.py

# Needs a Docker engine (none runs on CI); tests/slow/test_image.py checks the context.
image: $(STAMP)
	docker build -f deployments/container/Dockerfile -t kubegpu:$$($(BIN)/python -c 'import kubegpu; print(kubegpu.__version__)') .

# No Docker engine or image registry needed (root, Debian's archive and PyPI): buildah builds
# the Dockerfile unchanged on a debootstrap stand-in base, then runs `kubegpu info` inside.
image-offline: $(STAMP)
	deployments/container/build-offline.sh

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache .pytest_cache .coverage .coverage.* htmlcov
