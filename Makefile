# snapkv-bench: `make help`. Works in a venv (recommended) and with the system interpreter.
PY ?= python
# The supported transformers range (snapkv/compat.py): both ends are tested by test-compat.
COMPAT_LOW ?= 5.2.0
COMPAT_HIGH ?= 5.24.0
# Installed by `make install` when the interpreter has no torch (the CPU build where the index has one).
TORCH ?= 2.13.0
# `make test` starts the local SLURM cluster for the slurm tests where it can (root with apt-get, as
# in CI); elsewhere those tests skip, saying why. SLURM_UP= (empty) leaves it alone.
SLURM_UP ?= $(shell [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && echo yes)

.PHONY: help install test test-fast test-compat lint run report slurm-up slurm-down

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

install:  ## torch first unless torch is there, then the package with the harness (bench) extra; each step announced, never silent for >10 s (scripts/install.py)
	@$(PY) scripts/install.py --torch $(TORCH) --extras bench,dev,cluster,reasoning,openvino,kvquant

test: install  ## install, lint, both test tiers, then the version-sensitive tests on the ends of the transformers range
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(if $(SLURM_UP),$(MAKE) slurm-up)
	$(PY) -m pytest
	$(PY) -m pytest -m slow
	$(MAKE) test-compat PY="$(PY)" SKIP_CURRENT=1

test-fast:  ## the fast tier alone (plain pytest: tiny in-process models, minutes)
	$(PY) -m pytest

test-compat:  ## version-sensitive tests (.ci/compat.sh) on transformers $(COMPAT_LOW) and $(COMPAT_HIGH) (cached venvs that reuse this interpreter's torch)
	SKIP_CURRENT=$(SKIP_CURRENT) .ci/compat.sh "$(PY)" $(COMPAT_LOW)
	SKIP_CURRENT=$(SKIP_CURRENT) .ci/compat.sh "$(PY)" $(COMPAT_HIGH)

lint:  ## ruff lint + format check
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

run: install  ## the default job (offline): needle grid on SmolLM2 with SnapKV, rows + table + heatmap
	$(PY) run.py

slurm-up:  ## a one-node SLURM cluster with accounting on this machine (root, Debian; scripts/slurm.sh) and conf/local/slurm.yaml, the launcher settings it serves; a no-op when up
	scripts/slurm.sh up

slurm-down:  ## stop every daemon slurm-up started (its jobs are cancelled)
	scripts/slurm.sh down

report:  ## rebuild tables/plots of a results dir: make report DIR=results/needle
	$(PY) scripts/report.py $(DIR)
