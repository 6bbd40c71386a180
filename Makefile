# splitserve developer entry points. `make demo` and `make test` are the README quickstart.
PYTHON ?= python3
PYTEST_ARGS ?=

.PHONY: help deps install test test-unit test-e2e demo lint crds crds-check cluster-up cluster-down binaries bench

help:
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

deps: ## install Debian packages, the Python package (editable, all extras) and the control-plane binaries
	PYTHON=$(PYTHON) bash .ci/deps

install: ## install the package with all extras (editable)
	$(PYTHON) -m pip install -q -e ".[operator,runtime,dev]"

binaries: ## build or reuse the pinned control-plane binaries (~/.cache/splitserve/bin)
	$(PYTHON) -m splitserve_e2e.build

test: deps ## unit tests, then end-to-end tests on the local control plane
	$(PYTHON) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests e2e

test-unit: ## unit tests only (no cluster)
	$(PYTHON) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests

test-e2e: ## end-to-end tests only
	$(PYTHON) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) e2e

demo: deps ## local control plane + chart + tiny-model InferenceService + load burst + scaling report
	$(PYTHON) -m splitserve_e2e.demo $(DEMO_ARGS)

lint: ## ruff + mypy
	$(PYTHON) -m ruff check operator runtime e2e tests bench
	$(PYTHON) -m mypy operator/splitserve_operator runtime/splitserve_runtime e2e/splitserve_e2e

crds: ## regenerate crds/ and the chart's copy from the pydantic models
	$(PYTHON) -m splitserve_operator.crdgen

crds-check: ## fail when crds/ or the chart copy is stale
	$(PYTHON) -m splitserve_operator.crdgen --check

cluster-up: ## start the local control plane (detached); prints KUBECONFIG
	$(PYTHON) -m splitserve_e2e up

cluster-down: ## stop the local control plane and everything it started
	$(PYTHON) -m splitserve_e2e down

bench: ## CPU benchmarks (print figures)
	$(PYTHON) bench/cpu_engine.py
