# Every target that runs code first makes sure the project's own virtual environment
# exists and matches pyproject.toml, so each one works as the first command on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench proto venv clean static-manifests image image-offline

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip setuptools
	@$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kubegpu demo

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

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I src --python_out=src --grpc_python_out=src --pyi_out=src src/kubegpu/api/api.proto

static-manifests: $(STAMP)
	$(BIN)/python deployments/render-static.py

# Needs a Docker engine (none runs on CI); tests/unit/test_image.py checks the context.
image: $(STAMP)
	docker build -f deployments/container/Dockerfile -t kubegpu:$$($(BIN)/python -c 'import kubegpu; print(kubegpu.__version__)') .

# No Docker engine or image registry needed (root, Debian's archive and PyPI): buildah builds
# the Dockerfile unchanged on a debootstrap stand-in base, then runs `kubegpu info` inside.
image-offline: $(STAMP)
	deployments/container/build-offline.sh

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache .pytest_cache .coverage .coverage.* htmlcov
