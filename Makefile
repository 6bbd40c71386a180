# splitserve developer entry points. `make demo` and `make test` are the README quickstart.
PYTHON ?= python3
PYTEST_ARGS ?=
# Test order is fixed by default (-p no:randomly); `make test-shuffled` runs the same suite in
# a random order (pytest-randomly); it prints the seed, and `make test-shuffled SEED=N` repeats that order.
ORDER ?= -p no:randomly
SEED ?= $(shell date +%s)
PACKAGES = contract/splitserve_contract operator/splitserve_operator runtime/splitserve_runtime planner/splitserve_planner cli/splitserve_cli e2e/splitserve_e2e

.PHONY: help deps install test test-shuffled test-unit test-e2e demo lint format crds crds-check cluster-up cluster-down binaries bench soak

help:
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

deps: ## install Debian packages, the Python package (editable, all extras) and the control-plane binaries
	PYTHON=$(PYTHON) bash .ci/deps

install: ## install the package with all extras and the e2e harness (e2e/pyproject.toml), both editable
	$(PYTHON) -m pip install -q -e ".[operator,runtime,dev]" -e ./e2e

binaries: ## build or reuse the pinned control-plane binaries (~/.cache/splitserve/bin)
	$(PYTHON) -m splitserve_e2e.build

test: deps ## lint-imports, unit tests, then end-to-end tests on the local control plane
	lint-imports
	$(PYTHON) -m pytest -q -p no:cacheprovider $(ORDER) $(PYTEST_ARGS) tests e2e

test-shuffled: deps ## the whole suite in a random order (SEED=N repeats an order)
	@echo "==> test order shuffled with --randomly-seed=$(SEED)"
	$(PYTHON) -m pytest -q -p no:cacheprovider -p randomly --randomly-seed=$(SEED) $(PYTEST_ARGS) tests e2e

test-unit: ## unit tests only (no cluster)
	$(PYTHON) -m pytest -q -p no:cacheprovider $(ORDER) $(PYTEST_ARGS) tests

test-e2e: ## end-to-end tests only
	$(PYTHON) -m pytest -q -p no:cacheprovider $(ORDER) $(PYTEST_ARGS) e2e

demo: deps ## local control plane + chart + Disaggregated InferenceService under a load burst + scaling report + a SmolLM2 chat answer
	$(PYTHON) -m splitserve_e2e.demo $(DEMO_ARGS)

lint: ## ruff (lint and format), import layers (import-linter), mypy --strict on the packages, the tests and the benchmarks
	$(PYTHON) -m ruff check contract operator runtime planner cli e2e tests bench
	$(PYTHON) -m ruff format --check contract operator runtime planner cli e2e tests bench
	lint-imports
	$(PYTHON) -m mypy --strict $(PACKAGES)
	$(PYTHON) -m mypy --strict tests
	$(PYTHON) -m mypy --strict bench

format: ## apply ruff's formatter (make lint and CI check it)
	$(PYTHON) -m ruff format contract operator runtime planner cli e2e tests bench

crds: ## regenerate crds/, the chart's copy and docs/operator.md's API reference from the pydantic models
	$(PYTHON) operator/tools/crdgen.py

crds-check: ## fail when crds/, the chart copy or docs/operator.md's API reference is stale
	$(PYTHON) operator/tools/crdgen.py --check

cluster-up: ## start the local control plane (detached); prints KUBECONFIG
	$(PYTHON) -m splitserve_e2e up

cluster-down: ## stop the local control plane and everything it started
	$(PYTHON) -m splitserve_e2e down

soak: deps ## the operator soak at full length: 1,000 InferenceService create/delete cycles (make test runs 200)
	SPLITSERVE_SOAK_CYCLES=1000 $(PYTHON) -m pytest -q -s -p no:cacheprovider --timeout=3600 e2e/test_soak.py

.PHONY: image push
IMAGE ?=

image: ## build both container images, the bundled runtime's (Containerfile) and vLLM's CPU build (Containerfile.vllm), on a local Debian base with buildah, and push them to the loopback registry
	$(PYTHON) -m splitserve_e2e.image build

push: ## push the image to a registry: make push IMAGE=registry.example.com/splitserve:TAG
	@test -n "$(IMAGE)" || { echo "make push: set IMAGE=registry.example.com/splitserve:TAG" >&2; exit 2; }
	$(PYTHON) -m splitserve_e2e.image push $(IMAGE)

bench: ## CPU benchmarks (print figures)
	$(PYTHON) bench/cpu_engine.py
	$(PYTHON) bench/tensor_parallel.py
	$(PYTHON) bench/router_overhead.py
	$(PYTHON) bench/scheduler_side_by_side.py
	$(PYTHON) bench/sampler.py
	$(PYTHON) bench/kv_transfer.py
	$(PYTHON) bench/slo_autoscaling.py --ci
	$(PYTHON) bench/operator_reconcile.py
