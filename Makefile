# snapkv-bench: `make help`
PY ?= python

.PHONY: help install test test-compat lint run report

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

install:  ## torch CPU build first (a plain `torch` pulls a multi-GB CUDA build), then the package
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,cluster]"

test: install  ## install, lint, run every test (slow ones too), then the core suite on transformers 5.23
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest
	$(MAKE) test-compat

test-compat:  ## the cache seam at the low end of the pinned range: core tests on transformers 5.23
	$(PY) -m venv --system-site-packages .venv-compat
	.venv-compat/bin/python -m pip install -q "transformers==5.23.0"
	.venv-compat/bin/python -m pytest -q -p no:cacheprovider tests/test_core.py

lint:  ## ruff lint + format check
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

run: install  ## the default job (offline): needle grid on SmolLM2 with SnapKV, rows + table + heatmap
	$(PY) run.py

report:  ## rebuild tables/plots of a results dir: make report DIR=results/needle
	$(PY) -m eval.report $(DIR)
